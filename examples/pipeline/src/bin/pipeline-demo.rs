//! Drives the running orders and payments services (scripts/demo.sh
//! pipeline starts them): publishes orders with duplicates among them, waits
//! until the pipeline settles, prints what went in and what came out, and
//! exits non-zero unless every order was written, charged and paid exactly
//! once.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use pipeline_example::demo::{Tally, follow, publish_orders, wait_for_streams, wait_settled};

/// Publishes orders to the running pipeline and checks it applied each once.
#[derive(Debug, Parser)]
#[command(name = "pipeline-demo", after_help = AFTER_HELP)]
struct Options {
    /// Orders to place
    #[arg(long, value_name = "N", default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..1_000_000))]
    orders: u32,
}

const AFTER_HELP: &str = "\
Each order is published once, a tenth of them again at once (JetStream drops
those, inside its duplicate window), and another tenth after the window
(JetStream stores those again: only the claim stops them). Order ids start
at a number taken from the clock, so runs against the same servers do not
mix. NATS_URL and DATABASE_URL select the servers (both required).";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let options = Options::parse();
    let (nats, pool) = pipeline_example::connect()
        .await
        .map_err(|e| e.to_string())?;
    let js = async_nats::jetstream::new(nats);
    wait_for_streams(&js, Duration::from_secs(30)).await?;

    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
    let first = now * 1_000_000;
    let orders = first..first + i64::from(options.orders);
    let started = Instant::now();
    let sent = publish_orders(&js, orders.clone()).await?;
    let tally = wait_settled(&js, &pool, &orders, Duration::from_secs(120)).await;
    let elapsed = started.elapsed();
    let tally = match tally {
        Ok(tally) => tally,
        Err(error) => {
            eprintln!("pipeline-demo: {error}");
            Tally::read(&js, &pool, &orders).await?
        }
    };

    let Tally {
        placed_messages,
        orders: written,
        paid_once,
        paid_twice,
        charges,
        charged_orders,
        paid_messages,
        paid_message_orders,
        outbox_pending,
        dead_letters,
    } = tally;
    println!("idem pipeline example (orders -> payments -> orders)");
    println!(
        "  orders.placed published        {:>6}  ({} unique)",
        sent.published, sent.unique
    );
    println!(
        "  duplicates injected            {:>6}  ({} inside the window, {} after it)",
        sent.within_window + sent.after_window,
        sent.within_window,
        sent.after_window
    );
    println!(
        "  dropped by JetStream (window)  {:>6}",
        sent.dropped_by_jetstream
    );
    println!(
        "  orders.placed in the stream    {placed_messages:>6}  ({} stored twice: only the claim stops those)",
        placed_messages.saturating_sub(sent.unique)
    );
    println!("  orders written                 {written:>6}");
    println!("  charges                        {charges:>6}  ({charged_orders} distinct orders)");
    println!(
        "  orders.paid in the stream      {paid_messages:>6}  ({paid_message_orders} distinct orders)"
    );
    println!("  orders marked paid             {paid_once:>6}  ({paid_twice} more than once)");
    println!("  outbox rows pending            {outbox_pending:>6}");
    println!("  dead letters                   {dead_letters:>6}");
    println!(
        "  took                           {:>6.2}s",
        elapsed.as_secs_f64()
    );
    // The last order was also published again after the duplicate window:
    // its trace shows the copy the claim skipped too (in the services' logs).
    let followed = orders.end - 1;
    let hops = follow(&js, followed).await?;
    let trace_of = |hop: &pipeline_example::demo::Hop| {
        hop.traceparent
            .as_deref()
            .and_then(|traceparent| traceparent.split('-').nth(1))
            .map(str::to_owned)
    };
    let trace = trace_of(&hops[0]).unwrap_or_default();
    println!("  order {followed}, hop by hop (trace id, and the span that sent it):");
    for hop in &hops {
        let parent = hop
            .traceparent
            .as_deref()
            .and_then(|traceparent| traceparent.split('-').nth(2))
            .unwrap_or("-");
        let trace = trace_of(hop).unwrap_or_else(|| "none".to_owned());
        println!("    {:<19} trace {trace}  span {parent}", hop.subject);
    }
    let one_trace = !trace.is_empty()
        && hops
            .iter()
            .all(|hop| trace_of(hop).as_ref() == Some(&trace));
    if one_trace {
        println!("  followed in trace {trace}: every hop carries it");
    } else {
        println!("  NOT one trace: {hops:?}");
    }
    if tally.exactly_once(sent.unique) && one_trace {
        println!(
            "exactly once: each order written, charged and marked paid once, one orders.paid each"
        );
        Ok(())
    } else {
        println!("NOT exactly once: {tally:?}");
        Err("the pipeline's effects do not match its unique orders, or its trace broke".into())
    }
}
