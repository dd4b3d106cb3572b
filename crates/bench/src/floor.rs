//! The floor of nthbouncer's stack: a reverse proxy made of the same parts and nothing else, as a
//! peer row for `bench/run proxy` and `bench/run proxy --tls`.
//!
//! Why: issue #20 asks for nthbouncer at ≥ 1.0× nginx and HAProxy over TLS. This proxy has the
//! parts nthbouncer is built on, arranged the same way, with none of its features: hyper-util's
//! `auto` server (HTTP/1.1 and h2 on one listener), rustls on ring with the same protocol
//! versions, ALPN and session cache, one single-threaded runtime per connection thread with
//! connections handed to them in turn from one accept loop, and per thread a pool of idle
//! `hyper::client::conn::http1` connections to the origin, each driven by its own task. It adds
//! the three `X-Forwarded-*` headers nginx and HAProxy are configured to add, and nothing more:
//! no key, no slot, no gate headers, no request id, no access log, no timeouts. What
//! nthbouncer costs beyond it is what its features cost; what it costs beyond nginx is the
//! stack's.
//!
//! A benchmark peer only: it trusts its origin, answers `502` with no body when the origin fails,
//! and must never be deployed.

use std::cell::RefCell;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{Either, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::header::{HeaderValue, HOST};
use hyper::{Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio_rustls::TlsAcceptor;

use crate::BoxError;

#[derive(clap::Args)]
pub struct FloorArgs {
    #[arg(long)]
    listen: SocketAddr,
    /// The plain-HTTP origin, `host:port`.
    #[arg(long)]
    origin: String,
    /// Serve TLS with this PEM certificate chain (with `--key-file`).
    #[arg(long, requires = "key_file")]
    cert_file: Option<PathBuf>,
    #[arg(long, requires = "cert_file")]
    key_file: Option<PathBuf>,
    /// Connection threads; 0 = one per core, as nthbouncer's default.
    #[arg(long, default_value_t = 0)]
    connection_threads: usize,
    /// Exit after this long even if nobody stops us, so a forgotten peer cannot linger.
    #[arg(long, default_value_t = 1800)]
    max_seconds: u64,
}

type Answer = Response<Either<Incoming, Empty<Bytes>>>;

/// What every connection shares.
struct Floor {
    origin: HeaderValue,
    origin_addr: String,
    tls: Option<TlsAcceptor>,
    forwarded_proto: HeaderValue,
    builder: auto::Builder<TokioExecutor>,
}

thread_local! {
    /// This connection thread's idle origin connections: a current-thread runtime's tasks never
    /// leave it, so each thread's pool is its own and needs no lock.
    static IDLE: RefCell<Vec<http1::SendRequest<Incoming>>> = const { RefCell::new(Vec::new()) };
}

pub async fn run(args: FloorArgs) -> Result<(), BoxError> {
    let tls = match (&args.cert_file, &args.key_file) {
        (Some(cert), Some(key)) => Some(acceptor(cert, key)?),
        _ => None,
    };
    let floor = Arc::new(Floor {
        origin: HeaderValue::from_str(&args.origin)?,
        origin_addr: args.origin.clone(),
        forwarded_proto: HeaderValue::from_static(if tls.is_some() { "https" } else { "http" }),
        tls,
        builder: auto::Builder::new(TokioExecutor::new()),
    });
    let threads = match args.connection_threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    let handles = (0..threads)
        .map(connection_thread)
        .collect::<Result<Vec<_>, _>>()?;
    let listener = TcpListener::bind(args.listen).await?;
    println!("floor proxy listening on {}", listener.local_addr()?);
    let next = AtomicUsize::new(0);
    let accepting = async {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("floor: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let Ok(stream) = stream.into_std() else {
                continue;
            };
            let floor = floor.clone();
            let handle = &handles[next.fetch_add(1, Ordering::Relaxed) % handles.len()];
            handle.spawn(async move {
                if let Ok(stream) = TcpStream::from_std(stream) {
                    floor.connection(stream, peer).await;
                }
            });
        }
    };
    tokio::select! {
        () = accepting => Ok(()),
        () = tokio::time::sleep(Duration::from_secs(args.max_seconds)) => Ok(()),
    }
}

/// A thread running a single-threaded runtime for as long as the process lives.
fn connection_thread(i: usize) -> std::io::Result<Handle> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name(format!("floor-conn-{i}"))
        .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
    Ok(handle)
}

/// The listener's TLS as nthbouncer's `[server.tls]` sets it up: ring, TLS 1.3 and 1.2, ALPN
/// `h2` then `http/1.1`, an in-memory session cache and tickets.
fn acceptor(cert: &PathBuf, key: &PathBuf) -> Result<TlsAcceptor, BoxError> {
    let chain = CertificateDer::pem_file_iter(cert)?.collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.session_storage = rustls::server::ServerSessionMemoryCache::new(1024);
    config.ticketer = rustls::crypto::ring::Ticketer::new()?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

impl Floor {
    async fn connection(self: Arc<Self>, stream: TcpStream, peer: SocketAddr) {
        match &self.tls {
            None => self.serve(stream, peer).await,
            Some(tls) => {
                if let Ok(stream) = tls.accept(stream).await {
                    self.serve(stream, peer).await;
                }
            }
        }
    }

    async fn serve<I>(self: &Arc<Self>, io: I, peer: SocketAddr)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let client = HeaderValue::from_str(&peer.ip().to_string()).ok();
        let floor = self.clone();
        let service = hyper::service::service_fn(move |req| {
            let floor = floor.clone();
            let client = client.clone();
            async move { Ok::<_, Infallible>(floor.forward(req, client).await) }
        });
        // The client closing its connection mid-request at the end of a run is no news.
        let _ = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), service)
            .await;
    }

    /// Sends the request to the origin in origin form with the `X-Forwarded-*` headers, on an
    /// idle connection of this thread's pool or a new one, and passes the answer back.
    async fn forward(&self, mut req: Request<Incoming>, client: Option<HeaderValue>) -> Answer {
        let host = req
            .headers()
            .get(HOST)
            .cloned()
            .or_else(|| {
                let authority = req.uri().authority()?;
                HeaderValue::from_str(authority.as_str()).ok()
            })
            .unwrap_or_else(|| self.origin.clone());
        *req.uri_mut() = req
            .uri()
            .path_and_query()
            .map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()));
        *req.version_mut() = Version::HTTP_11;
        let headers = req.headers_mut();
        if let Some(client) = client {
            headers.insert("x-forwarded-for", client);
        }
        headers.insert("x-forwarded-proto", self.forwarded_proto.clone());
        headers.insert("x-forwarded-host", host);
        headers.insert(HOST, self.origin.clone());
        let sender = match IDLE.with_borrow_mut(|idle| idle.pop()) {
            Some(sender) if sender.is_ready() => Some(sender),
            _ => self.connect().await,
        };
        let Some(mut sender) = sender else {
            return bad_gateway();
        };
        let Ok(resp) = sender.send_request(req).await else {
            return bad_gateway();
        };
        checkin(sender);
        resp.map(Either::Left)
    }

    async fn connect(&self) -> Option<http1::SendRequest<Incoming>> {
        let stream = TcpStream::connect(&self.origin_addr).await.ok()?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.ok()?;
        tokio::spawn(connection);
        Some(sender)
    }
}

/// Back into this thread's pool once its answer has been read: at once for a small answer read
/// with its head, else from a task that waits for it.
fn checkin(mut sender: http1::SendRequest<Incoming>) {
    if sender.is_ready() {
        IDLE.with_borrow_mut(|idle| idle.push(sender));
        return;
    }
    if sender.is_closed() {
        return;
    }
    tokio::spawn(async move {
        if sender.ready().await.is_ok() {
            IDLE.with_borrow_mut(|idle| idle.push(sender));
        }
    });
}

fn bad_gateway() -> Answer {
    let mut resp = Response::new(Either::Right(Empty::new()));
    *resp.status_mut() = StatusCode::BAD_GATEWAY;
    resp
}
