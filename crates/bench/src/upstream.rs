//! The proxy benchmark's origin: answers every request with the same small body over HTTP/1.1
//! keep-alive, doing as little work as hyper allows, so the proxies in front of it are what is
//! measured.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::BoxError;

/// The body every request gets; small, so the proxies' per-request cost dominates.
pub const BODY: &[u8] = b"hello, world\n";

#[derive(clap::Args)]
pub struct UpstreamArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Exit after this long even if nobody stops us, so a forgotten upstream cannot linger.
    #[arg(long, default_value_t = 1800)]
    max_seconds: u64,
}

pub async fn run(args: UpstreamArgs) -> Result<(), BoxError> {
    let listener = TcpListener::bind(args.listen).await?;
    println!("upstream listening on http://{}", listener.local_addr()?);
    tokio::select! {
        () = serve(listener) => Ok(()),
        () = tokio::time::sleep(Duration::from_secs(args.max_seconds)) => Ok(()),
    }
}

/// Serves `listener` until the future is dropped (the scale benchmark runs it in its own
/// process, behind the server under test).
pub async fn serve(listener: TcpListener) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: back off rather than spin.
                eprintln!("upstream: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(|_req: Request<Incoming>| async {
                let mut resp = Response::new(Full::new(Bytes::from_static(BODY)));
                resp.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("text/plain"),
                );
                Ok::<_, Infallible>(resp)
            });
            // A connection error is the client's business (wrk closing mid-request at the
            // end of a run); nothing to report.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
