"""Which hosts an http(s) image may be fetched from (issue 58): the host rule, checked on the URL's host
name and again on every address it resolves to, so the connection goes only to an address that passed.

    rule = HostRule(hosts=("*.example.com",), allow_private=False)
    host, port = rule.target(url)           # ImageError: a host off the list, an odd address form
    address = rule.address(host, port)      # resolved and checked: connect to this one, never the name again

By default only public (globally routable, unicast) addresses pass: loopback, private (10/8, 172.16/12,
192.168/16), shared (100.64/10), link-local (169.254/16, fe80::/10), unique-local (fc00::/7), unspecified,
multicast, broadcast, reserved and documentation ranges are refused, and so is an IPv6 address that
carries an IPv4 one (::ffff:a.b.c.d, ::a.b.c.d, 64:ff9b::/96, 2002::/16) whose IPv4 address is refused.
allow_private (--image-allow-private) lets loopback, private, shared, link-local and unique-local
addresses pass; the cloud metadata addresses, unspecified, multicast and reserved ones never do.
A host written as a number in another form (2130706433, 0x7f000001, 0177.0.0.1, 127.1) is refused: it
names an address in a form meant to slip past host checks.
"""
from __future__ import annotations

import fnmatch
import ipaddress
import re
import socket
import urllib.parse
from dataclasses import dataclass

from jobrunner.images.image_error import ImageError

# the instance metadata services (AWS, GCP, Azure, OpenStack; AWS ECS; Alibaba): never, opt-in or not
METADATA = frozenset(ipaddress.ip_address(a) for a in
                     ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")       # a label of a decimal, octal or hex number
REFUSED = ("refused: its host is not a public address (loopback, private, link-local and metadata "
           "addresses are not fetched; --image-allow-private allows private hosts)")


@dataclass(frozen=True)
class HostRule:
    """hosts: the allow-list of host names and patterns (fnmatch: `*.example.com`; empty: any host);
    allow_private: private hosts pass too (never the metadata addresses)."""
    hosts: tuple[str, ...] = ()
    allow_private: bool = False

    def target(self, url: str) -> tuple[str, int]:
        """(host, port) of an http(s) URL whose host name the rule lets through; ImageError otherwise."""
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError as e:
            raise ImageError(f"not a valid URL ({e})") from None
        host = normal_host(parts.hostname or "")
        if self.hosts and not any(fnmatch.fnmatchcase(host, p.lower().rstrip(".")) for p in self.hosts):
            raise ImageError(f"refused: host {host!r} is not in --image-hosts")
        return host, port

    def address(self, host: str, port: int) -> str:
        """The first address of `host` the rule lets through (a literal address: itself), to connect
        to; ImageError when it resolves to none that passes (one message, whichever address it was)."""
        literal = _literal(host)
        if literal is not None:
            candidates = [literal]
        else:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError) as e:
                raise ImageError(f"cannot fetch it (cannot resolve its host: {e})") from None
            candidates = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        for candidate in candidates:
            if self.passes(candidate):
                return str(candidate)
        raise ImageError(REFUSED)

    def passes(self, address) -> bool:
        """Whether a connection may go to `address` (an ipaddress address)."""
        if address in METADATA:
            return False
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return self.passes(embedded)
        if address.is_unspecified or address.is_multicast or address.is_reserved:
            return False
        if address.is_global:
            return True
        private = address.is_private or address.is_loopback or address.is_link_local or \
            address in ipaddress.ip_network("100.64.0.0/10")
        return self.allow_private and private


def normal_host(host: str) -> str:
    """A URL's host as the rule compares it: lower case, no trailing dot, IDNA (xn--) for other scripts,
    an IP address in its standard form; ImageError for no host or a number in another form."""
    host = host.strip().lower().rstrip(".")
    if not host:
        raise ImageError("refused: the URL has no host")
    literal = _literal(host)
    if literal is not None:
        return str(literal)
    if all(_NUMERIC_LABEL.match(label) for label in host.split(".")):
        raise ImageError(f"refused: host {host!r} is an address written in a non-standard form")
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        raise ImageError(f"refused: host {host!r} is not a valid host name") from None


def _literal(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _embedded_ipv4(address):
    """The IPv4 address an IPv6 one carries (mapped, compatible, NAT64, 6to4), else None."""
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if int(address) >> 32 == 0 or address in _NAT64:        # ::a.b.c.d (and ::1), 64:ff9b::a.b.c.d
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None
