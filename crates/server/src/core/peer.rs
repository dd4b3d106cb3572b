//! A connection's peer address, formatted once per connection (`app::serve`): every request on
//! the connection reuses the text for its `X-Forwarded-For` and its access-log line instead of
//! formatting the address again.

use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use http::HeaderValue;

/// The peer of a connection and its address as text (a header value: cloning it is a
/// reference count).
#[derive(Clone, Debug)]
pub struct Peer {
    addr: SocketAddr,
    ip_text: HeaderValue,
}

impl Peer {
    pub fn new(addr: SocketAddr) -> Peer {
        let text = addr.ip().to_string();
        // An address's text is ASCII digits, dots, colons and hex: always a valid value.
        let ip_text = HeaderValue::from_maybe_shared(Bytes::from(text))
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Peer { addr, ip_text }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn ip(&self) -> IpAddr {
        self.addr.ip()
    }

    /// The peer's IP address as `IpAddr`'s `Display` writes it.
    pub fn ip_text(&self) -> &HeaderValue {
        &self.ip_text
    }

    /// `ip` as text: the formatted peer's when `ip` is the peer's own address.
    pub fn text_of(&self, ip: IpAddr) -> Option<HeaderValue> {
        (ip == self.addr.ip()).then(|| self.ip_text.clone())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_text_is_the_address_as_displayed() {
        for addr in ["10.1.2.3:80", "[::1]:443", "[::ffff:10.0.0.1]:8080"] {
            let addr: SocketAddr = addr.parse().unwrap();
            let peer = Peer::new(addr);
            assert_eq!(peer.ip_text().to_str().unwrap(), addr.ip().to_string());
            assert_eq!(peer.text_of(addr.ip()), Some(peer.ip_text().clone()));
        }
        // A client resolved to another address (a mapped IPv4 peer's canonical form, an
        // address from a trusted proxy's header) is formatted by whoever needs it.
        let mapped = Peer::new("[::ffff:10.0.0.1]:8080".parse().unwrap());
        assert_eq!(mapped.text_of("10.0.0.1".parse().unwrap()), None);
    }
}
