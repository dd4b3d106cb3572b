//! Raw loopback sockets for the connection tests: one HTTP/1 response read off a kept-alive
//! connection, and reading until the server closes.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::wait::bounded;

/// A bare HTTP/1 `/healthz` request on the API host.
pub const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: api.localhost\r\n\r\n";

/// A new raw connection to `addr` that has sent `bytes`.
pub async fn connect_and_send(addr: impl tokio::net::ToSocketAddrs, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s
}

/// Reads one HTTP/1 response with a `Content-Length` body, leaving the connection open.
pub async fn read_response(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed mid-response: {}",
            String::from_utf8_lossy(&out)
        );
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out).into_owned();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let length = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())?
            })
            .unwrap_or(0);
        if body.len() >= length {
            return text;
        }
    }
}

/// Reads until the server closes the connection (a reset counts as closed); what it sent.
/// Bounded: a server that keeps the connection open fails the test naming `what`.
pub async fn closed_by_server(s: &mut TcpStream, what: &str) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    bounded(what, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Asserts `answer` is the `503 overloaded` a connection past the limit gets, with
/// `Connection: close`.
pub fn assert_refused_overloaded(answer: &str) {
    let lower = answer.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 503"), "{answer}");
    assert!(lower.contains("connection: close"), "{answer}");
    assert!(answer.contains(r#""error":"overloaded""#), "{answer}");
}
