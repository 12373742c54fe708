"""Personal data out of traffic text, before anything of it is stored: each e-mail address, phone number, IP address
(v4 and v6), credit-card-like number, API key or bearer token is replaced by its kind in brackets (`[EMAIL]`), and
counted by kind. It runs in the control plane, where the gateway's logs are read (assets/traffic.py): only its output
reaches the host, the logs, the metadata.

Why not Presidio: its pattern recognizers run without a spaCy model, but importing `presidio_analyzer` imports spaCy
(its NlpArtifacts type is a spaCy Doc), and with it numpy and thinc: the Dagster processes import neither
(pyproject.toml's import contracts). What is hard to get right by pattern is taken from the library Presidio itself
uses: phone numbers by `phonenumbers` (Google's libphonenumber metadata, pure Python: a number is kept only when
valid for its region), and the validation of the rest from the standard library (`ipaddress`) or the card
networks' own checksum (Luhn). API keys and tokens are found by `common/secrets.py`, the same patterns that keep
secrets out of run configs. Names and postal addresses need a language model, and are not found here."""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

import phonenumbers

from ..common.secrets import secret_spans

KINDS = ("email", "phone", "ip_address", "credit_card", "api_key", "bearer_token", "private_key")
_SECRET_KINDS = {"a private key (PEM block)": "private_key", "a bearer token": "bearer_token",
                 "a JSON web token": "bearer_token"}  # every other kind secrets.py names is a key: api_key

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
# hex groups joined by ':' (a '::' somewhere), an IPv4 tail allowed, a zone (%eth0) allowed; ipaddress decides
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{1,4}|:)(?::[0-9A-Fa-f]{0,4}){2,7}(?:\.\d{1,3}){0,3}(?:%[\w.]+)?"
                   r"(?![\w:])")
# 13-19 digits, single spaces or dashes between them (4111 1111 1111 1111, 4111-1111-1111-1111)
_CARD = re.compile(r"(?<![\d.,-])\d(?:[ -]?\d){12,18}(?![\d]|[.,]\d)")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _ipv6(text: str) -> bool:
    """A valid IPv6 address of three groups or more: a slice (`x[1::2]`) or a ratio is none."""
    try:
        ipaddress.IPv6Address(text.split("%", 1)[0])
    except ValueError:
        return False
    groups = text.split("%", 1)[0].split(":")
    return sum(bool(g) for g in groups) + ("." in groups[-1]) >= 3  # an IPv4 tail holds two groups


def _ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


class Redactor:
    """`redact(text)` -> (text with each finding replaced by `[KIND]`, Counter of kinds). `phone_region`: where a
    number written without its country code (+1, +44) is read as from; a number is a phone number only when
    valid there (or valid with the code it carries)."""

    def __init__(self, phone_region: str = "US"):
        self.phone_region = phone_region.upper()

    def spans(self, text: str) -> list[tuple[str, int, int]]:
        found = [(_SECRET_KINDS.get(kind, "api_key"), a, b) for kind, a, b in secret_spans(text)]
        found += [("email", m.start(), m.end()) for m in _EMAIL.finditer(text)]
        found += [("ip_address", m.start(), m.end()) for m in _IPV4.finditer(text) if _ipv4(m.group())]
        found += [("ip_address", m.start(), m.end()) for m in _IPV6.finditer(text) if _ipv6(m.group())]
        found += [("credit_card", m.start(), m.end()) for m in _CARD.finditer(text)
                  if _luhn(re.sub(r"[ -]", "", m.group()))]
        if any(c.isdigit() for c in text):
            found += [("phone", m.start, m.end) for m in phonenumbers.PhoneNumberMatcher(
                text, self.phone_region, leniency=phonenumbers.Leniency.VALID)]
        # overlapping findings: the one that starts first wins, the longer one at the same start (a card number
        # that a phone matcher reads in part is one card number)
        kept, end = [], -1
        for kind, a, b in sorted(found, key=lambda s: (s[1], -s[2])):
            if a >= end:
                kept.append((kind, a, b))
                end = b
            elif b > end:  # a longer overlapping finding extends the last one
                kept[-1] = (kept[-1][0], kept[-1][1], b)
                end = b
        return kept

    def redact(self, text: str) -> tuple[str, Counter]:
        spans = self.spans(text)
        if not spans:
            return text, Counter()
        out, at = [], 0
        for kind, a, b in spans:
            out += [text[at:a], f"[{kind.upper()}]"]
            at = b
        out.append(text[at:])
        return "".join(out), Counter(kind for kind, _, _ in spans)
