//! `idem`: operate an idem deployment from the command line.
//!
//! A thin layer over the runtime's public functions
//! (`idem_runtime::status`, `idem_runtime::dead_letter`,
//! `idem_runtime::retention::expiry`, `idem_runtime::schema`, `idem_runtime::outbox`):
//! whatever it shows or does, a program can do with the library too. The
//! database URL's scheme chooses PostgreSQL, SQLite or MariaDB (`connect.rs`). See
//! `idem --help`, and the guide's "Operating" chapter (`idem_runtime::guide::operating`).

mod args;
mod connect;
mod dead_letters;
mod maintenance;
mod outbox;
mod output;
mod status;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use idem_runtime::dead_letter::ReplayOptions;

use crate::args::{Cli, Command, DeadLetterAction, Dedup, OutboxAction};
use crate::connect::Create;
use crate::dead_letters::ReplaySettings;
use crate::output::{CliError, Report};

fn main() -> ExitCode {
    // clap prints its own errors and exits 2 on a bad command line.
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let json = cli.json;
    match runtime.block_on(run(cli)) {
        Ok(report) => {
            print(&report, json);
            match report.incomplete {
                Some(error) => {
                    eprintln!("{}", error.render());
                    ExitCode::from(error.exit_code())
                }
                None => ExitCode::SUCCESS,
            }
        }
        Err(error) => {
            eprintln!("{}", error.render());
            ExitCode::from(error.exit_code())
        }
    }
}

fn print(report: &Report, json: bool) {
    let mut stdout = std::io::stdout().lock();
    // A closed pipe (`idem ... | head`) is not an error worth a panic.
    let _ = if json {
        writeln!(
            stdout,
            "{}",
            serde_json::to_string_pretty(&report.json).unwrap_or_default()
        )
    } else {
        writeln!(stdout, "{}", report.text)
    };
}

async fn run(cli: Cli) -> Result<Report, CliError> {
    let nats_url = cli.nats_url.as_deref();
    let database_url = cli.database_url.as_deref();
    match cli.command {
        Command::Status => {
            let database = connect::verified_database(database_url).await?;
            let js = connect::nats(nats_url).await?;
            status::status(&js, &database).await
        }
        Command::DeadLetters(dead) => {
            let js = connect::nats(nats_url).await?;
            let stream = dead.stream.as_str();
            match dead.action {
                DeadLetterAction::List { filter } => dead_letters::list(&js, stream, &filter).await,
                DeadLetterAction::Show { sequence } => {
                    dead_letters::show(&js, stream, sequence).await
                }
                DeadLetterAction::Replay {
                    target,
                    dry_run,
                    discard,
                    allow_new_message_id,
                    allow_outside_retention,
                    for_handler,
                } => {
                    let mut options = ReplayOptions::default();
                    if let Some(name) = for_handler {
                        options = options.for_handler(name);
                    }
                    if allow_new_message_id {
                        options = options.allow_new_message_id();
                    }
                    if allow_outside_retention {
                        options = options.allow_outside_retention();
                    }
                    let settings = ReplaySettings {
                        dry_run,
                        discard,
                        options,
                    };
                    dead_letters::replay(&js, stream, &target, settings).await
                }
                DeadLetterAction::Discard { target, dry_run } => {
                    dead_letters::discard(&js, stream, &target, dry_run).await
                }
            }
        }
        Command::Dedup(Dedup::Check {
            handler,
            message_id,
        }) => {
            let database = connect::verified_database(database_url).await?;
            status::check(&database, &handler, &message_id).await
        }
        Command::Outbox(OutboxAction::Retry { subject }) => {
            let database = connect::verified_database(database_url).await?;
            outbox::retry(&database, subject.as_deref()).await
        }
        Command::Purge => {
            let database = connect::verified_database(database_url).await?;
            maintenance::purge(&database).await
        }
        Command::Migrate => {
            let database = connect::database(database_url, Create::IfTheUrlAsks).await?;
            maintenance::migrate(&database).await
        }
        Command::Verify => {
            let database = connect::database(database_url, Create::Never).await?;
            maintenance::verify(&database).await
        }
    }
}
