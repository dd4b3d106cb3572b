//! Which addresses a webhook may not reach unless `server.allow_private_webhooks` is set:
//! loopback, private (RFC 1918, unique-local), link-local, site-local, CGNAT, unspecified,
//! multicast, broadcast, documentation ranges and cloud metadata endpoints — and the same behind
//! an IPv6 form that carries an IPv4 address (IPv4-mapped, IPv4-compatible, IPv4-translated,
//! NAT64, 6to4), which reaches that IPv4 address through the host's stack or a translator and so
//! is judged by it. Tunnel and local-use prefixes whose destination cannot be judged from the
//! address (NAT64 local-use, Teredo) are refused outright.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::Ipv6Net;

use crate::core::error::ApiError;

/// How long saving a destination waits for its name to resolve.
const SAVE_RESOLVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Refuses webhook URLs (at `field`) that name or resolve to a private address, unless private webhooks are allowed.
/// A name that cannot be resolved now is accepted: every delivery attempt resolves it again and
/// connects only to an address that passes the same check (DNS rebinding).
pub async fn check_webhook_url(
    field: &str,
    url: &str,
    allow_private: bool,
) -> Result<(), ApiError> {
    let uri = nthbouncer_config::parse_http_url(field, url)
        .map_err(|e| ApiError::invalid(field, e.rule))?;
    if allow_private {
        return Ok(());
    }
    let host = uri
        .host()
        .unwrap_or("")
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let mut private = host == "localhost"
        || host.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| is_private(&ip));
    if !private && host.parse::<std::net::IpAddr>().is_err() {
        let port = uri
            .port_u16()
            .unwrap_or(if uri.scheme_str() == Some("https") {
                443
            } else {
                80
            });
        let lookup = tokio::net::lookup_host((host.as_str(), port));
        if let Ok(Ok(addrs)) = tokio::time::timeout(SAVE_RESOLVE_TIMEOUT, lookup).await {
            private = addrs.into_iter().any(|a| is_private(&a.ip()));
        }
    }
    if private {
        return Err(ApiError::invalid(
            field,
            "webhook destinations may not point at loopback, private, link-local or metadata addresses \
             (set server.allow_private_webhooks = true for local testing)",
        ));
    }
    Ok(())
}

/// NAT64 well-known prefix (RFC 6052): the last 32 bits are the IPv4 address reached.
const NAT64: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0), 96);
/// NAT64 local-use prefix (RFC 8215): translated by the operator's own gear, to wherever it
/// routes; nothing in the address says where.
const NAT64_LOCAL_USE: Ipv6Net =
    Ipv6Net::new_assert(Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0), 48);
/// 6to4 (RFC 3056): bits 16..48 are the IPv4 address of the site.
const SIX_TO_FOUR: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::new(0x2002, 0, 0, 0, 0, 0, 0, 0), 16);
/// IPv4-compatible addresses (RFC 4291 §2.5.5.1, deprecated): `::a.b.c.d`.
const IPV4_COMPATIBLE: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::UNSPECIFIED, 96);
/// IPv4-translated addresses (RFC 2765 SIIT): `::ffff:0:a.b.c.d`.
const IPV4_TRANSLATED: Ipv6Net =
    Ipv6Net::new_assert(Ipv6Addr::new(0, 0, 0, 0, 0xffff, 0, 0, 0), 96);
/// Site-local (RFC 3879 deprecated it, but stacks may still route it inside a site).
const SITE_LOCAL: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0), 10);
/// Teredo (RFC 4380): tunnelled over IPv4 through relays, the client's address obfuscated.
const TEREDO: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::new(0x2001, 0, 0, 0, 0, 0, 0, 0), 32);
/// Discard-only (RFC 6666).
const DISCARD_ONLY: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::new(0x100, 0, 0, 0, 0, 0, 0, 0), 64);

pub fn is_private(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_private_v4(v4),
        IpAddr::V6(v6) => is_private_v6(v6) || embedded_v4(v6).is_some_and(|v4| is_private_v4(&v4)),
    }
}

/// The IPv4 address an IPv6 address stands for, in the forms that embed one.
fn embedded_v4(ip: &Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(v4);
    }
    let o = ip.octets();
    if NAT64.contains(ip) || IPV4_COMPATIBLE.contains(ip) || IPV4_TRANSLATED.contains(ip) {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if SIX_TO_FOUR.contains(ip) {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

fn is_private_v4(ip: &Ipv4Addr) -> bool {
    let [a, b, _, _] = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local() // 169.254/16, includes the 169.254.169.254 metadata endpoint
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // CGNAT 100.64/10
        || (a == 192 && b == 0 && ip.octets()[2] == 0) // IETF protocol assignments
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || a >= 240 // reserved
}

fn is_private_v6(ip: &Ipv6Addr) -> bool {
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || ip.is_unique_local() // fc00::/7, includes AWS IMDS over IPv6 (fd00:ec2::254)
        || ip.is_unicast_link_local() // fe80::/10
        || SITE_LOCAL.contains(ip)
        || NAT64_LOCAL_USE.contains(ip)
        || TEREDO.contains(ip)
        || DISCARD_ONLY.contains(ip)
        || (ip.segments()[0] == 0x2001 && ip.segments()[1] == 0x0db8) // documentation
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn classifies_addresses() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fc00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "fd00:ec2::254",
        ] {
            assert!(is_private(&private.parse().unwrap()), "{private}");
        }
        for public in ["1.1.1.1", "8.8.8.8", "2606:4700::1111", "100.128.0.1"] {
            assert!(!is_private(&public.parse().unwrap()), "{public}");
        }
    }

    /// IPv6 forms that carry an IPv4 address are judged by it, and prefixes whose destination
    /// the address does not tell are refused. Before, every one of the "private" column passed
    /// (issue #12): a webhook to `64:ff9b::7f00:1` reached loopback through NAT64.
    #[test]
    fn ipv6_forms_that_carry_ipv4_are_judged_by_it() {
        for private in [
            // NAT64 well-known prefix: loopback, RFC 1918, metadata, CGNAT behind it.
            "64:ff9b::127.0.0.1",
            "64:ff9b::10.0.0.1",
            "64:ff9b::169.254.169.254",
            "64:ff9b::100.64.0.1",
            // NAT64 local-use: refused whatever it embeds.
            "64:ff9b:1::8.8.8.8",
            "64:ff9b:1:ffff::1",
            // 6to4 of private IPv4.
            "2002:7f00:1::1",
            "2002:a9fe:a9fe::",
            "2002:c0a8:101:1::1",
            // IPv4-compatible and IPv4-translated.
            "::127.0.0.1",
            "::10.1.2.3",
            "::169.254.169.254",
            "::ffff:0:127.0.0.1",
            "::ffff:0:192.168.0.1",
            // Site-local, Teredo, discard-only.
            "fec0::1",
            "feff:ffff::1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "100::1",
        ] {
            assert!(is_private(&private.parse().unwrap()), "{private}");
        }
        for public in [
            "64:ff9b::8.8.8.8",
            "64:ff9b::1.1.1.1",
            "2002:808:808::1",
            "::8.8.8.8",
            "::ffff:0:1.1.1.1",
            "::ffff:8.8.8.8",
            // Next to the refused prefixes, not in them.
            "64:ff9b:2::1",
            "2001:1::1",
            "2003::1",
        ] {
            assert!(!is_private(&public.parse().unwrap()), "{public}");
        }
    }
}
