//! Which addresses are of the public internet: what the broker may connect to for
//! sandboxed code (code mode's `http.fetch`, package egress) when a name resolves there.

use std::net::{IpAddr, Ipv4Addr};

/// Whether `ip` is an address of the public internet: not loopback, private, link-local,
/// unique-local, shared (CGNAT), unspecified, multicast, broadcast, documentation or
/// reserved. IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4) are judged by it;
/// local-use NAT64 (`64:ff9b:1::/48`) is never public, as its translation is the local
/// network's own.
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public_v4(v4);
            }
            let seg = v6.segments();
            let embedded = |hi: u16, lo: u16| {
                Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)
            };
            if seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return is_public_v4(embedded(seg[6], seg[7]));
            }
            if seg[..3] == [0x64, 0xff9b, 1] {
                return false; // local-use NAT64: translated into the operator's network
            }
            if seg[0] == 0x2002 {
                return is_public_v4(embedded(seg[1], seg[2]));
            }
            !(v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || seg[..6] == [0; 6] // IPv4-compatible (deprecated)
                || (seg[0] & 0xfe00) == 0xfc00 // unique local
                || (seg[0] & 0xffc0) == 0xfe80 // link-local
                || (seg[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
                || (seg[0] == 0x2001 && seg[1] == 0x0db8) // documentation
                || seg[..4] == [0x0100, 0, 0, 0]) // discard
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0 // "this network", unspecified
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local() // the cloud metadata service is here
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || (a == 100 && (b & 0xc0) == 64) // shared address space (CGNAT)
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (b & 0xfe) == 18) // benchmarking
        || a >= 240) // reserved
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_addresses() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.17.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            // Local-use NAT64 (RFC 8215): translated by the operator's own network, to
            // addresses this policy cannot see.
            "64:ff9b:1::a9fe:a9fe",
            "64:ff9b:1:ffff::808:808",
            "2002:7f00:1::",
            "::127.0.0.1",
            // Cloud metadata services besides 169.254.169.254: AWS over IPv6, Alibaba.
            "fd00:ec2::254",
            "100.100.100.200",
            "::ffff:100.100.100.200",
        ] {
            assert!(!is_public(private.parse().expect("ip")), "{private}");
        }
        for public in [
            "93.184.216.34",
            "1.1.1.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert!(is_public(public.parse().expect("ip")), "{public}");
        }
    }
}
