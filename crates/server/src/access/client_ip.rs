//! The client address (SPEC §9): the TCP peer, or — when the peer is one of
//! `server.trusted_proxies` — the right-most `X-Forwarded-For` hop that is not a trusted proxy.
//!
//! Right-most, because each proxy appends the address it saw: everything to the left of the
//! first untrusted hop was written by someone we do not trust and may be spoofed. Addresses are
//! normalised (`::ffff:10.0.0.1` is `10.0.0.1`) so that IPv4 allowlists match dual-stack peers.

use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;
use ipnet::IpNet;

const X_FORWARDED_FOR: &str = "x-forwarded-for";

fn trusted(ip: IpAddr, nets: &[IpNet]) -> bool {
    nets.iter().any(|n| n.contains(&ip))
}

/// One `X-Forwarded-For` hop: an IP, optionally with a port (`1.2.3.4:80`, `[::1]:80`, `[::1]`).
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Ok(sa) = hop.parse::<SocketAddr>() {
        return Some(sa.ip().to_canonical());
    }
    hop.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .and_then(|h| h.parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical())
}

/// The address the request comes from, as far as we can trust the path it took.
pub fn client_addr(peer: IpAddr, headers: &HeaderMap, trusted_proxies: &[IpNet]) -> IpAddr {
    let peer = peer.to_canonical();
    if !trusted(peer, trusted_proxies) {
        return peer;
    }
    // The nearest address we know to be real so far: a trusted proxy's.
    let mut current = peer;
    let lines: Vec<_> = headers.get_all(X_FORWARDED_FOR).iter().collect();
    for line in lines.into_iter().rev() {
        // A hop we cannot read ends the walk: what lies left of it is unknowable.
        let Ok(text) = line.to_str() else {
            return current;
        };
        for hop in text.rsplit(',').map(str::trim).filter(|h| !h.is_empty()) {
            match parse_hop(hop) {
                Some(ip) if trusted(ip, trusted_proxies) => current = ip,
                Some(ip) => return ip,
                None => return current,
            }
        }
    }
    current
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn xff(lines: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for l in lines {
            h.append(X_FORWARDED_FOR, l.parse().unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_peer_is_the_client_unless_it_is_trusted() {
        let t = nets(&["10.0.0.0/8"]);
        let h = xff(&["1.1.1.1"]);
        assert_eq!(client_addr(ip("192.0.2.7"), &h, &t), ip("192.0.2.7"));
        assert_eq!(client_addr(ip("192.0.2.7"), &h, &[]), ip("192.0.2.7"));
        assert_eq!(client_addr(ip("10.1.2.3"), &h, &t), ip("1.1.1.1"));
    }

    #[test]
    fn the_right_most_untrusted_hop_wins_over_spoofed_ones() {
        let t = nets(&["10.0.0.0/8", "fd00::/8"]);
        // The client spoofed 7.7.7.7; the first proxy saw 203.0.113.9; a second one saw 10.0.0.2.
        let h = xff(&["7.7.7.7, 203.0.113.9", "10.0.0.2"]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &t), ip("203.0.113.9"));
        let h = xff(&["7.7.7.7,203.0.113.9:5123,[fd00::1]:443"]);
        assert_eq!(client_addr(ip("fd00::2"), &h, &t), ip("203.0.113.9"));
        // Every hop trusted: the left-most one is the best we know.
        let h = xff(&["10.9.9.9, 10.0.0.2"]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &t), ip("10.9.9.9"));
        // No header at all: the trusted peer itself.
        assert_eq!(
            client_addr(ip("10.0.0.1"), &HeaderMap::new(), &t),
            ip("10.0.0.1")
        );
        // Garbage stops the walk at the last trusted hop, never skipping to a spoofed value.
        let h = xff(&["7.7.7.7, not-an-ip, 10.0.0.2"]);
        assert_eq!(client_addr(ip("10.0.0.1"), &h, &t), ip("10.0.0.2"));
    }

    #[test]
    fn ipv4_mapped_addresses_are_normalised() {
        let t = nets(&["127.0.0.0/8"]);
        let h = xff(&["::ffff:198.51.100.4"]);
        assert_eq!(
            client_addr(ip("::ffff:127.0.0.1"), &h, &t),
            ip("198.51.100.4")
        );
        assert_eq!(
            client_addr(ip("::ffff:198.51.100.4"), &HeaderMap::new(), &[]),
            ip("198.51.100.4")
        );
    }
}
