//! A TCP proxy in front of PostgreSQL that can cut a connection right after
//! the server has executed a COMMIT, before the client hears the result: the
//! ambiguous commit, for real. It can also orphan a transaction: drop the
//! COMMIT and the client's connection, but keep the server's side open, as a
//! network partition leaves a backend that never hears from its client again.
//! Or it can blackhole one: swallow the COMMIT and from then on forward
//! nothing on that connection in either direction, while keeping both
//! sockets open, as when the network drops every packet after the COMMIT
//! left the client (no RST, no FIN; sqlx sets no TCP keepalive).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// SSLRequest and GSSENCRequest codes: sent before the startup message.
const NEGOTIATION_CODES: [u32; 2] = [80_877_103, 80_877_104];

#[derive(Default)]
struct Control {
    /// Cut the connection that sends the next COMMIT.
    armed: AtomicBool,
    /// Connections cut after their COMMIT reached the server.
    cuts: AtomicUsize,
    /// Orphan the connection that sends the next COMMIT.
    orphan: AtomicBool,
    /// The server sides of orphaned connections, kept open.
    orphaned: Mutex<Vec<OwnedWriteHalf>>,
    /// Blackhole the connection that sends the next COMMIT.
    blackhole: AtomicBool,
    /// COMMITs swallowed by a blackhole.
    swallowed: AtomicUsize,
}

/// The proxy; stops accepting when dropped.
pub struct PgProxy {
    addr: SocketAddr,
    control: Arc<Control>,
    accept: JoinHandle<()>,
}

impl PgProxy {
    /// Listens on a random loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy binds");
        let addr = listener.local_addr().expect("proxy address");
        let control = Arc::new(Control::default());
        let accept_control = control.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let control = accept_control.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(client, server, control).await;
                    }
                });
            }
        });
        Self {
            addr,
            control,
            accept,
        }
    }

    /// `database_url` with its host and port replaced by the proxy's.
    pub fn url_for(&self, database_url: &str) -> String {
        let (scheme, rest) = database_url.split_once("://").expect("a URL");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let userinfo = authority
            .rsplit_once('@')
            .map(|(userinfo, _)| format!("{userinfo}@"))
            .unwrap_or_default();
        format!("{scheme}://{userinfo}{}/{path}", self.addr)
    }

    /// Cuts the connection that sends the next COMMIT, after the server has
    /// run it and before its answer reaches the client.
    pub fn cut_next_commit(&self) {
        self.control.armed.store(true, Ordering::SeqCst);
    }

    /// How many connections were cut after a COMMIT.
    pub fn cuts(&self) -> usize {
        self.control.cuts.load(Ordering::SeqCst)
    }

    /// Orphans the transaction that sends the next COMMIT: the COMMIT is not
    /// forwarded, the client's connection is closed, and the server's is
    /// kept open (so its backend stays in the transaction, holding its
    /// locks, until the server itself ends it).
    pub fn orphan_next_commit(&self) {
        self.control.orphan.store(true, Ordering::SeqCst);
    }

    /// How many transactions were orphaned.
    pub fn orphans(&self) -> usize {
        self.control.orphaned.lock().unwrap().len()
    }

    /// Blackholes the connection that sends the next COMMIT: the COMMIT is
    /// never forwarded, and from then on nothing goes through that
    /// connection either way, while both of its sockets stay open. The
    /// client waits for an answer that never comes; the server's backend
    /// stays in the transaction until the server itself ends it.
    pub fn blackhole_next_commit(&self) {
        self.control.blackhole.store(true, Ordering::SeqCst);
    }

    /// How many COMMITs a blackhole swallowed.
    pub fn swallowed(&self) -> usize {
        self.control.swallowed.load(Ordering::SeqCst)
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The upstream address of a `postgres://user@host:port/db` URL.
pub fn upstream_of(database_url: &str) -> SocketAddr {
    let rest = database_url.split_once("://").expect("a URL").1;
    let authority = rest
        .split_once('/')
        .map_or(rest, |(authority, _)| authority);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let host_port = host_port.replace("localhost", "127.0.0.1");
    host_port.parse().expect("host:port of the database URL")
}

async fn relay(client: TcpStream, server: TcpStream, control: Arc<Control>) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let commit_sent = Arc::new(AtomicBool::new(false));
    let frozen = Arc::new(AtomicBool::new(false));
    let mut upstream = tokio::spawn(client_to_server(
        client_read,
        server_write,
        control.clone(),
        commit_sent.clone(),
        frozen.clone(),
    ));
    let mut downstream = tokio::spawn(server_to_client(
        server_read,
        client_write,
        control,
        commit_sent,
        frozen,
    ));
    // When either direction ends, end the other: both sockets close.
    tokio::select! {
        _ = &mut upstream => downstream.abort(),
        _ = &mut downstream => upstream.abort(),
    }
}

async fn client_to_server(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    control: Arc<Control>,
    commit_sent: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
) -> std::io::Result<()> {
    // The untyped start: optional negotiation requests, then the startup
    // message.
    loop {
        let length = from.read_u32().await?;
        let mut body = vec![0; length as usize - 4];
        from.read_exact(&mut body).await?;
        to.write_u32(length).await?;
        to.write_all(&body).await?;
        let code = u32::from_be_bytes(body[..4].try_into().unwrap_or([0; 4]));
        if !NEGOTIATION_CODES.contains(&code) {
            break;
        }
    }
    loop {
        let kind = from.read_u8().await?;
        let length = from.read_u32().await?;
        let mut body = vec![0; length as usize - 4];
        from.read_exact(&mut body).await?;
        // A simple query that commits: `COMMIT`, or several statements one
        // of which is (not one that only names `synchronous_commit`).
        let is_commit = kind == b'Q'
            && body
                .split(|&byte| byte == b';' || byte == 0)
                .any(|statement| {
                    let statement = statement.trim_ascii().to_ascii_uppercase();
                    statement == b"COMMIT" || statement.starts_with(b"COMMIT ")
                });
        if is_commit && control.orphan.swap(false, Ordering::SeqCst) {
            control.orphaned.lock().unwrap().push(to);
            return Ok(());
        }
        if is_commit && control.blackhole.swap(false, Ordering::SeqCst) {
            frozen.store(true, Ordering::SeqCst);
            control.swallowed.fetch_add(1, Ordering::SeqCst);
            // Keep both sockets open, forward nothing, forever.
            let _open = (from, to);
            return std::future::pending().await;
        }
        // Flag it before the server can answer, so the answer is never
        // forwarded.
        if is_commit && control.armed.swap(false, Ordering::SeqCst) {
            commit_sent.store(true, Ordering::SeqCst);
        }
        to.write_u8(kind).await?;
        to.write_u32(length).await?;
        to.write_all(&body).await?;
    }
}

async fn server_to_client(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    control: Arc<Control>,
    commit_sent: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let read = from.read(&mut buffer).await?;
        if frozen.load(Ordering::SeqCst) {
            // Neither the server's answers nor its closing reach the
            // client.
            let _open = (from, to);
            return std::future::pending().await;
        }
        if read == 0 {
            return Ok(());
        }
        if commit_sent.load(Ordering::SeqCst) {
            // The server answered the COMMIT, so it ran; the client never
            // hears how.
            control.cuts.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        to.write_all(&buffer[..read]).await?;
    }
}
