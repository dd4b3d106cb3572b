//! The one HTTP client every call to an origin goes through (proxy, job runner, JWKS fetches),
//! and its replacement when a reload changes its timeouts ([`SharedClient`]).

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::connector::TrackedConnector;
use super::direct::DirectPool;
use crate::core::live::ServerSettings;

pub type UpstreamClient = Client<hyper_rustls::HttpsConnector<TrackedConnector>, Body>;

/// What one call to an origin goes through: the pooled client, and for a plain-HTTP origin
/// the lane's direct HTTP/1 pool ([`DirectPool`]) when the call may use it (not a pool with
/// its own `[pools.upstream_tls]` client).
#[derive(Clone)]
pub struct CallClient {
    pub pooled: Arc<UpstreamClient>,
    pub direct: Option<Arc<DirectPool>>,
}

impl CallClient {
    /// Only the pooled client (a pool's own TLS client).
    pub fn pooled(pooled: Arc<UpstreamClient>) -> CallClient {
        CallClient {
            pooled,
            direct: None,
        }
    }
}

/// The server's settings every upstream client is built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientTimeouts {
    pub connect: Duration,
    pub idle: Duration,
}

impl ClientTimeouts {
    pub fn of(server: &ServerSettings) -> ClientTimeouts {
        ClientTimeouts {
            connect: server.upstream_connect_timeout,
            idle: server.upstream_idle_timeout,
        }
    }
}

/// The shared upstream client, as the last reload left it. A call takes the current client
/// ([`SharedClient::get`]) and keeps it to its end: a reload that changes the timeouts builds
/// a new client for the calls after it, and the old one (with its pooled connections) goes
/// away once its last call is done.
///
/// One client per lane: lane 0 for the main runtime (job runners, JWKS fetches), one for each
/// connection thread (`app::serve::threads`). A pooled connection's task runs where it was
/// opened, so a connection thread's calls reuse connections driven on that same thread and
/// an answer never crosses threads (a cross-thread wake-up costs a futex and a context
/// switch, as much as the rest of a small call). The price: each thread keeps its own idle
/// connections to an origin.
pub struct SharedClient {
    current: ArcSwap<Built>,
    lanes: usize,
}

struct Built {
    timeouts: ClientTimeouts,
    /// Lane 0 first, then one per connection thread.
    clients: Clients,
}

/// A client for each lane, built together.
pub struct Clients {
    main: Arc<UpstreamClient>,
    /// Lanes 1.. (the connection threads).
    threads: Vec<Arc<UpstreamClient>>,
    /// Each lane's direct HTTP/1 pool, lane 0 first.
    direct: Vec<Arc<DirectPool>>,
}

thread_local! {
    /// This thread's lane: 0 unless [`enter_lane`] said otherwise.
    static LANE: Cell<usize> = const { Cell::new(0) };
}

/// Makes this thread's calls use lane `lane`'s client (a connection thread, at its start).
pub fn enter_lane(lane: usize) {
    LANE.with(|l| l.set(lane));
}

impl Clients {
    fn build(timeouts: ClientTimeouts, lanes: usize) -> Result<Clients, rustls::Error> {
        Ok(Clients {
            main: Arc::new(build_client(timeouts)?),
            threads: (1..lanes)
                .map(|_| build_client(timeouts).map(Arc::new))
                .collect::<Result<Vec<_>, _>>()?,
            direct: (0..lanes.max(1))
                .map(|_| Arc::new(DirectPool::new(tracked(timeouts), timeouts.idle)))
                .collect(),
        })
    }

    fn of_lane(&self, lane: usize) -> &Arc<UpstreamClient> {
        lane.checked_sub(1)
            .and_then(|i| self.threads.get(i))
            .unwrap_or(&self.main)
    }

    fn direct_of_lane(&self, lane: usize) -> Option<&Arc<DirectPool>> {
        self.direct.get(lane).or_else(|| self.direct.first())
    }
}

impl SharedClient {
    /// `lanes`: 1 plus the number of connection threads.
    pub fn new(timeouts: ClientTimeouts, lanes: usize) -> Result<SharedClient, rustls::Error> {
        let clients = Clients::build(timeouts, lanes)?;
        Ok(SharedClient {
            current: ArcSwap::from_pointee(Built { timeouts, clients }),
            lanes,
        })
    }

    /// The client for a call starting now, on this thread's lane.
    pub fn get(&self) -> Arc<UpstreamClient> {
        self.current
            .load()
            .clients
            .of_lane(LANE.with(Cell::get))
            .clone()
    }

    /// The clients for a proxied call or a job's call starting now, on this thread's lane.
    pub fn for_call(&self) -> CallClient {
        let built = self.current.load();
        let lane = LANE.with(Cell::get);
        CallClient {
            pooled: built.clients.of_lane(lane).clone(),
            direct: built.clients.direct_of_lane(lane).cloned(),
        }
    }

    /// Clients with `timeouts`, when they differ from the current ones': built before a
    /// reload publishes anything (so a failure changes nothing), put in place by
    /// [`SharedClient::install`].
    pub fn prepare(&self, timeouts: ClientTimeouts) -> Result<Option<Clients>, rustls::Error> {
        if self.current.load().timeouts == timeouts {
            return Ok(None);
        }
        Clients::build(timeouts, self.lanes).map(Some)
    }

    /// Makes `clients` (built by [`SharedClient::prepare`] with `timeouts`) the current ones.
    pub fn install(&self, timeouts: ClientTimeouts, clients: Clients) {
        self.current.store(Arc::new(Built { timeouts, clients }));
    }
}

/// Builds the shared upstream client: keep-alive pool whose idle connections are closed by a
/// timer below typical upstream keep-alive timeouts, so we never write into a connection the
/// upstream is about to close.
pub fn build_client(timeouts: ClientTimeouts) -> Result<UpstreamClient, rustls::Error> {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())?
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(tracked(timeouts));
    Ok(pooled(timeouts, https))
}

/// A client of its own for a pool with `[pools.upstream_tls]`: its CA, its client certificate,
/// its SNI name (so its connections are never shared with other pools' to the same origin).
pub fn build_tls_client(
    timeouts: ClientTimeouts,
    config: rustls::ClientConfig,
    server_name: Option<rustls_pki_types::ServerName<'static>>,
) -> UpstreamClient {
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http();
    let builder = match server_name {
        Some(name) => {
            builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let https = builder
        .enable_http1()
        .enable_http2()
        .wrap_connector(tracked(timeouts));
    pooled(timeouts, https)
}

fn tracked(timeouts: ClientTimeouts) -> TrackedConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(timeouts.connect));
    TrackedConnector(http)
}

fn pooled(
    timeouts: ClientTimeouts,
    https: hyper_rustls::HttpsConnector<TrackedConnector>,
) -> UpstreamClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(timeouts.idle)
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(1024)
        .build(https)
}
