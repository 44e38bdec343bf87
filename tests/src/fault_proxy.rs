//! A TCP proxy that injects network faults between a client and a server, on
//! command: it **pauses** traffic (in one direction or both), **drops**
//! connections (an orderly close, FIN, to both ends) or **resets** them
//! (`SO_LINGER` 0 then close: an RST to both ends), and counts what it did,
//! so that a test can check that each fault it ordered really happened.
//!
//! It speaks no protocol: put one in front of PostgreSQL, another in front of
//! nats-server, and point the client at [`FaultProxy::url_for`].
//!
//! A pause models a partition that heals: the proxy keeps reading what the
//! paused side sends, holds it, and delivers it in order once the pause
//! ends, as TCP would after retransmitting. The sender never sees back
//! pressure (a real partition would block it once its send buffer fills;
//! the tests' volumes are far below that). New connections accepted during a
//! pause are held too. A connection whose sender closes while paused gets
//! the held bytes first, then the close.
//!
//! The proxy runs on a thread and runtime of its own, so that it keeps
//! forwarding even while the test blocks its own runtime (a `waitpid`, a
//! reader thread join). Dropping it closes every connection.
//!
//! ```no_run
//! # async fn demo(env: idem_tests::TestEnv) {
//! use std::time::Duration;
//! use idem_tests::fault_proxy::{Cut, Direction, FaultProxy};
//!
//! let proxy = FaultProxy::start("postgres", env.database_url());
//! let url = proxy.url_for(env.database_url()); // give this to the client
//! proxy.pause(Direction::Both);
//! tokio::time::sleep(Duration::from_secs(1)).await;
//! let pause = proxy.resume();
//! assert!(pause.held_bytes() > 0, "traffic was held: {pause:?}");
//! let cut = proxy.cut(Cut::Reset).await;
//! assert!(cut > 0, "a live connection was reset");
//! # drop(url);
//! # }
//! ```

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

/// Which way traffic is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the client to the server (queries, publishes, acks).
    ToServer,
    /// From the server to the client (results, deliveries, PONGs).
    ToClient,
    /// Both ways.
    Both,
}

impl Direction {
    fn holds(self, way: Way) -> bool {
        matches!(
            (self, way),
            (Direction::Both, _)
                | (Direction::ToServer, Way::ToServer)
                | (Direction::ToClient, Way::ToClient)
        )
    }
}

/// How [`FaultProxy::cut`] ends the live connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Shut both sockets down (FIN to both ends), then close them.
    Drop,
    /// Close both sockets with `SO_LINGER` 0: an RST to both ends.
    Reset,
}

/// One direction of a relayed connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    ToServer,
    ToClient,
}

/// What one pause did, returned by [`FaultProxy::resume`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paused {
    pub direction: Direction,
    pub lasted: Duration,
    /// Bytes the client sent during the pause, held and delivered after it.
    pub held_to_server: u64,
    /// Bytes the server sent during the pause, held and delivered after it.
    pub held_to_client: u64,
}

impl Paused {
    /// All bytes the pause held: above 0 shows it really stopped traffic.
    pub fn held_bytes(&self) -> u64 {
        self.held_to_server + self.held_to_client
    }
}

/// What the proxy has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Connections accepted from clients.
    pub accepted: u64,
    /// Connections relayed right now.
    pub live: u64,
    /// Connections the upstream server refused (the client's is closed).
    pub upstream_refused: u64,
    /// Connections ended with FIN by [`Cut::Drop`].
    pub dropped: u64,
    /// Connections ended with RST by [`Cut::Reset`].
    pub reset: u64,
    /// Pauses that ended.
    pub pauses: u64,
    /// Bytes held by all pauses, per direction.
    pub held_to_server: u64,
    pub held_to_client: u64,
}

/// A cut order for one connection, and where to report that it is done.
type CutOrder = (Cut, oneshot::Sender<()>);

#[derive(Default)]
struct Shared {
    /// The live connections' cut switches, by connection number.
    live: Mutex<HashMap<u64, oneshot::Sender<CutOrder>>>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    upstream_refused: AtomicU64,
    dropped: AtomicU64,
    reset: AtomicU64,
    pauses: AtomicU64,
    held_to_server: AtomicU64,
    held_to_client: AtomicU64,
}

impl Shared {
    fn held(&self, way: Way) -> &AtomicU64 {
        match way {
            Way::ToServer => &self.held_to_server,
            Way::ToClient => &self.held_to_client,
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<CutOrder>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The pause in force, if any, and when it began with what counts.
#[derive(Debug, Clone, Copy)]
struct PauseState {
    direction: Direction,
    since: Instant,
    held_to_server: u64,
    held_to_client: u64,
}

/// A fault-injecting TCP proxy on a random loopback port. See the module
/// docs.
pub struct FaultProxy {
    name: String,
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    pause: watch::Sender<Option<PauseState>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on a random loopback port and forwards each connection to
    /// the host and port of `upstream_url` (`nats://127.0.0.1:4222`,
    /// `postgres://user@127.0.0.1:5432/db`, or a bare `host:port`). `name`
    /// labels it in messages.
    ///
    /// # Panics
    ///
    /// If the URL names no `host:port`, or no port can be bound.
    pub fn start(name: &str, upstream_url: &str) -> FaultProxy {
        let upstream = socket_addr_of(upstream_url);
        let listener = StdListener::bind("127.0.0.1:0").expect("the fault proxy binds");
        listener
            .set_nonblocking(true)
            .expect("the proxy listener is non-blocking");
        let addr = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(Shared::default());
        let (pause, _) = watch::channel(None);
        let (stop, stopped) = oneshot::channel();
        let thread = {
            let (shared, pause) = (shared.clone(), pause.clone());
            std::thread::Builder::new()
                .name(format!("fault-proxy-{name}"))
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("the proxy's runtime starts");
                    runtime.block_on(async move {
                        let listener = TcpListener::from_std(listener)
                            .expect("the listener joins the runtime");
                        tokio::select! {
                            _ = stopped => {}
                            _ = accept(listener, upstream, shared, pause) => {}
                        }
                    });
                    // Dropping the runtime drops every relay: all sockets close.
                })
                .expect("the proxy thread starts")
        };
        FaultProxy {
            name: name.to_owned(),
            addr,
            upstream,
            shared,
            pause,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server it forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// `url` with its host and port replaced by the proxy's; the scheme,
    /// user info, path and query stay.
    pub fn url_for(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let (authority, tail) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let userinfo = authority
            .rsplit_once('@')
            .map(|(userinfo, _)| format!("{userinfo}@"))
            .unwrap_or_default();
        let scheme = if scheme.is_empty() {
            String::new()
        } else {
            format!("{scheme}://")
        };
        format!("{scheme}{userinfo}{}{tail}", self.addr)
    }

    /// Stops forwarding in `direction`, on every connection, new ones too,
    /// until [`FaultProxy::resume`]. What arrives meanwhile is held.
    pub fn pause(&self, direction: Direction) {
        self.pause.send_replace(Some(PauseState {
            direction,
            since: Instant::now(),
            held_to_server: self.shared.held_to_server.load(Ordering::SeqCst),
            held_to_client: self.shared.held_to_client.load(Ordering::SeqCst),
        }));
    }

    /// Ends the pause: the held bytes go out, in order. Returns what the
    /// pause held.
    ///
    /// # Panics
    ///
    /// If no pause is in force.
    pub fn resume(&self) -> Paused {
        let state = self
            .pause
            .send_replace(None)
            .unwrap_or_else(|| panic!("{}: resume() without a pause", self.name));
        self.shared.pauses.fetch_add(1, Ordering::SeqCst);
        Paused {
            direction: state.direction,
            lasted: state.since.elapsed(),
            held_to_server: self.shared.held_to_server.load(Ordering::SeqCst)
                - state.held_to_server,
            held_to_client: self.shared.held_to_client.load(Ordering::SeqCst)
                - state.held_to_client,
        }
    }

    /// Ends every live connection the way `cut` says, and returns how many
    /// it ended (once their sockets are closed). New connections are
    /// accepted as before.
    pub async fn cut(&self, cut: Cut) -> usize {
        let switches: Vec<_> = self.shared.live().drain().map(|(_, s)| s).collect();
        let mut done = Vec::new();
        for switch in switches {
            let (tx, rx) = oneshot::channel();
            // A connection that ended on its own meanwhile is not counted.
            if switch.send((cut, tx)).is_ok() {
                done.push(rx);
            }
        }
        let mut cut_count = 0;
        for rx in done {
            if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(5), rx).await {
                cut_count += 1;
            }
        }
        cut_count
    }

    /// What the proxy has done so far.
    pub fn counts(&self) -> Counts {
        let load = |c: &AtomicU64| c.load(Ordering::SeqCst);
        let s = &self.shared;
        Counts {
            accepted: load(&s.accepted),
            live: s.live().len() as u64,
            upstream_refused: load(&s.upstream_refused),
            dropped: load(&s.dropped),
            reset: load(&s.reset),
            pauses: load(&s.pauses),
            held_to_server: load(&s.held_to_server),
            held_to_client: load(&s.held_to_client),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("name", &self.name)
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .field("counts", &self.counts())
            .finish()
    }
}

/// The `host:port` of a URL (or of a bare `host:port`), `localhost` read as
/// 127.0.0.1.
fn socket_addr_of(url: &str) -> SocketAddr {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    host_port
        .replace("localhost", "127.0.0.1")
        .parse()
        .unwrap_or_else(|e| panic!("no host:port in {url:?}: {e}"))
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    pause: watch::Sender<Option<PauseState>>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of file descriptors, say: try again in a moment.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        let (switch, cut) = oneshot::channel();
        shared.live().insert(id, switch);
        let (shared, pause) = (shared.clone(), pause.subscribe());
        tokio::spawn(async move {
            relay(client, upstream, &shared, pause, cut).await;
            shared.live().remove(&id);
        });
    }
}

/// Relays one connection until either end closes it or it is cut.
async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    shared: &Shared,
    pause: watch::Receiver<Option<PauseState>>,
    cut: oneshot::Receiver<CutOrder>,
) {
    let mut server = match TcpStream::connect(upstream).await {
        Ok(server) => server,
        Err(_) => {
            // Like a refused connection: the client's socket just closes.
            shared.upstream_refused.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let order = {
        // Borrowed halves: unlike owned ones they send no FIN when dropped,
        // so a reset below is a bare RST.
        let (mut from_client, mut to_client) = client.split();
        let (mut from_server, mut to_server) = server.split();
        let up = pump(
            &mut from_client,
            &mut to_server,
            Way::ToServer,
            shared,
            pause.clone(),
        );
        let down = pump(
            &mut from_server,
            &mut to_client,
            Way::ToClient,
            shared,
            pause,
        );
        tokio::select! {
            _ = up => None,
            _ = down => None,
            order = cut => order.ok(),
        }
    };
    match order {
        Some((Cut::Reset, done)) => {
            let _ = client.set_zero_linger();
            let _ = server.set_zero_linger();
            drop((client, server));
            shared.reset.fetch_add(1, Ordering::SeqCst);
            let _ = done.send(());
        }
        Some((Cut::Drop, done)) => {
            let _ = client.shutdown().await;
            let _ = server.shutdown().await;
            drop((client, server));
            shared.dropped.fetch_add(1, Ordering::SeqCst);
            let _ = done.send(());
        }
        // One end closed (or failed): both sockets close as they drop.
        None => {}
    }
}

/// Copies `from` to `to` until `from` closes, holding what arrives while a
/// pause covers this direction and delivering it once the pause ends.
async fn pump(
    from: &mut ReadHalf<'_>,
    to: &mut WriteHalf<'_>,
    way: Way,
    shared: &Shared,
    mut pause: watch::Receiver<Option<PauseState>>,
) -> io::Result<()> {
    let paused = |pause: &watch::Receiver<Option<PauseState>>| {
        pause.borrow().is_some_and(|p| p.direction.holds(way))
    };
    let mut buffer = vec![0; 32 * 1024];
    let mut held = Vec::new();
    loop {
        if !held.is_empty() && !paused(&pause) {
            to.write_all(&held).await?;
            held.clear();
        }
        tokio::select! {
            read = from.read(&mut buffer) => {
                let read = read?;
                if read == 0 {
                    // The sender closed: what the pause holds still arrives,
                    // once it ends, before the close.
                    if !held.is_empty() {
                        let _ = pause.wait_for(|p| !p.is_some_and(|p| p.direction.holds(way))).await;
                        to.write_all(&held).await?;
                    }
                    return Ok(());
                }
                if paused(&pause) {
                    held.extend_from_slice(&buffer[..read]);
                    shared.held(way).fetch_add(read as u64, Ordering::SeqCst);
                } else {
                    to.write_all(&buffer[..read]).await?;
                }
            }
            changed = pause.changed() => {
                if changed.is_err() {
                    // The proxy is gone.
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_everything_but_the_host_and_port() {
        let proxy = FaultProxy::start("test", "127.0.0.1:9");
        let addr = proxy.addr();
        assert_eq!(
            proxy.url_for("postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"),
            format!("postgres://postgres@{addr}/postgres?sslmode=disable")
        );
        assert_eq!(
            proxy.url_for("nats://127.0.0.1:4222"),
            format!("nats://{addr}")
        );
        assert_eq!(
            socket_addr_of("postgres://u:p@localhost:5433/db"),
            "127.0.0.1:5433".parse().unwrap()
        );
    }

    /// An echo server behind the proxy: a pause holds bytes and delivers
    /// them afterwards; a drop ends the client's connection with EOF, a
    /// reset with ECONNRESET; new connections still work after each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pauses_hold_bytes_and_cuts_end_connections() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = socket.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let proxy = FaultProxy::start("echo", &echo_addr.to_string());
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut reply = [0; 5];

        client.write_all(b"hello").await.unwrap();
        client.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"hello");

        proxy.pause(Direction::ToClient);
        client.write_all(b"world").await.unwrap();
        let early = tokio::time::timeout(Duration::from_millis(300), client.read(&mut reply)).await;
        assert!(early.is_err(), "nothing arrives while paused");
        let pause = proxy.resume();
        assert_eq!((pause.held_to_server, pause.held_to_client), (0, 5));
        client.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"world", "held bytes arrive after the pause");

        assert_eq!(proxy.cut(Cut::Drop).await, 1);
        assert_eq!(
            client.read(&mut reply).await.unwrap(),
            0,
            "EOF after a drop"
        );

        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        client.write_all(b"again").await.unwrap();
        client.read_exact(&mut reply).await.unwrap();
        assert_eq!(proxy.cut(Cut::Reset).await, 1);
        let error = client.read(&mut reply).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);

        let counts = proxy.counts();
        assert_eq!(
            (counts.accepted, counts.dropped, counts.reset, counts.pauses),
            (2, 1, 1, 1)
        );
    }
}
