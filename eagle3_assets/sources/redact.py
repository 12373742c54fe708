"""Personal data out of traffic text, before anything of it is stored: each e-mail address, phone number, IP address
(v4 and v6), credit-card-like number, API key or bearer token, credential in a URL, national identifier, company
tax number or IBAN is replaced by its kind in brackets (`[EMAIL]`), and counted by kind (KINDS: the `traffic`
asset's `redacted_<kind>` metadata). It runs in the control plane, where the gateway's logs are read
(eye/traffic.py): only its output reaches the host, the logs, the metadata.

Why not Presidio: its pattern recognizers run without a spaCy model, but importing `presidio_analyzer` imports spaCy
(its NlpArtifacts type is a spaCy Doc), and with it numpy and thinc: the Dagster processes import neither
(pyproject.toml's import contracts). What is hard to get right by pattern is taken from the libraries Presidio itself
uses: phone numbers by `phonenumbers` (Google's libphonenumber metadata, pure Python: a number is kept only when
valid for its region), national and tax identifiers by `python-stdnum` (pure Python, no download: each format's
own check digits), and the validation of the rest from the standard library (`ipaddress`) or the card networks'
own checksum (Luhn). API keys and tokens are found by `common/secrets.py`, the same patterns that keep secrets out
of run configs. Names and postal addresses need a language model, and are not found here.

Identifiers (_IDS): a candidate is found by its written shape (digits with the usual separators, letters where the
format has them) and redacted only when stdnum's validator accepts it, so an order number of the same shape whose
check digits fail is kept. `[NATIONAL_ID]`: a person's number: US SSN, BR CPF, IN Aadhaar and PAN, ES DNI/NIE, IT
codice fiscale, FR NIR (sécurité sociale), MX CURP, CN resident ID. `[COMPANY_ID]`: BR CNPJ and EU VAT numbers (by
country prefix). `[IBAN]`: any country's IBAN. A format with no check digit (US SSN; IN PAN, a shape and a holder
letter) is a candidate only in its own written shape (NNN-NN-NNNN, AAAPA9999A), never as bare digits. An SSN-shaped
number is taken when stdnum's `us.ssn` accepts it (no area 000, 666 or 9xx, no group 00, no serial 0000, none of the
numbers known to be invalid) and no order-ish word stands right before it (_ORDER_BEFORE: order, invoice, ticket,
tracking, ref/reference, confirmation, case, PO, SKU, part, item, model, serial, '#', 'No.'): a gateway's `Order
#482-19-7305` is an order id and is kept; a personal word in the same clause (SSN, social security: _PERSONAL_BEFORE)
takes it all the same (`SSN #536-22-1847`), and so does plain text with no such word. Bare digit
runs are taken where the check is strong: CPF and CNPJ (2 check digits: 1 random number in 100 passes), FR NIR (1 in
97), CN resident ID (a birth date and a check); an Aadhaar (12 digits, 2-9 first, one Verhoeff digit) passes for 1
such number in 10: taken all the same, since a leaked ID costs more than an id-like number lost from a prompt. Left
out: bare digits with one check digit or none (DE IdNr, PT NIF; GB NINO: stdnum has none), which would take order
numbers; their VAT forms (DE..., PT...) are found.

`[IP_ADDRESS]`: a valid IPv4 dotted quad, or a valid IPv6 address of three groups or more. A dotted quad that is a
version is kept (_VERSION_BEFORE): after `version`, `ver`, `v`, `release` or `build` (any case, then an optional ':'
and spaces: `version 4.10.2.7`, `Build: 1.2.3.4`), glued to a `v` (`v4.10.2.7`), after a version specifier's operator
(`foo==4.10.2.7`, `>=`, `<=`, `!=`, `~=`, `===`), after a package name and '@' (`foo@1.2.3.4`; not in a login, which
is an address: `ssh root@10.0.0.5`, `user@10.0.0.5:path`), or in a release's file name (`foo-1.2.3.4.tar.gz`,
`foo-1.2.3.4-py3-none-any.whl`). A bare `10.0.0.5` or `connect to 192.168.1.20` is an address.

`[URL_CREDENTIAL]`: the user-info of a URL (`https://TOKEN@github.com/...`, `postgres://user:PASS@host/db`)
becomes `https://[URL_CREDENTIAL]@github.com/...`: scheme, host and path kept, and nothing inside it is counted
again (no `[EMAIL]` for `PASS@host`)."""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

import phonenumbers
from stdnum import iban
from stdnum.br import cnpj, cpf
from stdnum.cn import ric
from stdnum.es import dni, nie
from stdnum.eu import vat
from stdnum.fr import nir
from stdnum.in_ import aadhaar, pan
from stdnum.it import codicefiscale
from stdnum.mx import curp
from stdnum.us import ssn

from ..common.secrets import secret_spans

KINDS = ("email", "phone", "ip_address", "credit_card", "api_key", "bearer_token", "private_key", "url_credential",
         "national_id", "company_id", "iban")
_SECRET_KINDS = {"a private key (PEM block)": "private_key", "a bearer token": "bearer_token",
                 "a JSON web token": "bearer_token"}  # every other kind secrets.py names is a key: api_key

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
# What makes a dotted quad a version, read in the text right before it (and after it, for a file name): a version
# word, a version specifier's operator, a package name and '@' (not a login: ssh/scp/... before it, or a ':path'
# after it), a release's file name (name-1.2.3.4.tar.gz, name-1.2.3.4-py3-none-any.whl)
_VERSION_BEFORE = re.compile(r"(?:\b(?:version|ver|v|release|build)\s*:?\s*|(?:===?|[!~<>]=)\s*)\Z", re.I)
_PIN_BEFORE = re.compile(r"(?<![\w.@/-])@?[A-Za-z][\w.-]*(?:/[A-Za-z][\w.-]*)?@\Z")
_LOGIN_BEFORE = re.compile(r"\b(?:ssh|scp|sftp|rsync|mosh|telnet|ftp|log\s*in)\b[^\n]*\Z", re.I)
_FILE_BEFORE, _FILE_AFTER = re.compile(r"[A-Za-z][\w.+]*-\Z"), re.compile(r"(?:\.[A-Za-z]|-[A-Za-z\d])")
# hex groups joined by ':' (a '::' somewhere), an IPv4 tail allowed, a zone (%eth0) allowed; ipaddress decides
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{1,4}|:)(?::[0-9A-Fa-f]{0,4}){2,7}(?:\.\d{1,3}){0,3}(?:%[\w.]+)?"
                   r"(?![\w:])")
# An SSN-shaped number right after one of these is an order-ish id (`Order #482-19-7305`, `invoice no. ...`,
# `ref: ...`), unless a personal word stands in the same clause before it (`SSN #...`, `social security no. ...`;
# the clause ends at a '.' before a word, not at 'No. 482')
_ORDER_BEFORE = re.compile(r"(?:\b(?:order|invoice|ticket|tracking|ref|reference|confirmation|case|po|sku|part|item|"
                           r"model|serial)(?:\s*(?:number|num|no|nr|id|code)\b)?\.?|#|\bno\.)\s*[:#]?\s*\Z", re.I)
_PERSONAL_BEFORE = re.compile(r"\b(?:ssn|ssa|social\s+security|soc\.?\s*sec|taxpayer|itin)\b"
                              r"(?:[^\n.;!?]|\.(?!\s+[A-Z]))*\Z", re.I)
# 13-19 digits, single spaces or dashes between them (4111 1111 1111 1111, 4111-1111-1111-1111)
_CARD = re.compile(r"(?<![\d.,-])\d(?:[ -]?\d){12,18}(?![\d]|[.,]\d)")
# a URL's user-info: what stands between '://' and the authority's last '@' (a password may hold an unescaped '@')
_URL_USERINFO = re.compile(r"(?<=[A-Za-z0-9+.-])://([^\s/?#<>\"'`]+)@")

# Identifiers: (kind, candidate shape, validators, trim). A candidate is redacted when a validator accepts it.
# Digits glued to a longer number, a version or a path (1.529.982.247-25, v123-45-6789) are no candidate.
_L, _R = r"(?<![\w.,/-])", r"(?![\w]|[.,/-]\w)"
_EU_VAT = "|".join(sorted({c.upper() for c in vat.MEMBER_STATES} | {"EL"}))
_IDS = (
    # SSN: no check digit (stdnum refuses only unissued areas/groups and known-invalid numbers): only its dashed or
    # spaced shape, never 9 bare digits, or most 9-digit numbers would go; and not after an order-ish word
    ("national_id", re.compile(_L + r"\d{3}([- ])\d{2}\1\d{4}" + _R), (ssn,), False),
    ("national_id", re.compile(_L + r"\d{3}\.?\d{3}\.?\d{3}-?\d{2}" + _R), (cpf,), False),  # 2 check digits
    ("company_id", re.compile(_L + r"\d{2}\.?\d{3}\.?\d{3}/?\d{4}-?\d{2}" + _R), (cnpj,), False),  # 2 check digits
    ("national_id", re.compile(_L + r"[2-9]\d{3}([ -]?)\d{4}\1\d{4}" + _R), (aadhaar,), False),  # Verhoeff
    ("national_id", re.compile(_L + r"[12] ?\d{2} ?\d{2} ?(?:\d{2}|2[AB]) ?\d{3} ?\d{3} ?\d{2}" + _R), (nir,), False),
    ("national_id", re.compile(_L + r"\d{17}[\dX]" + _R), (ric,), False),  # birth date + ISO 7064 check
    ("national_id", re.compile(r"(?<![\w-])(?:\d{8}|[XYZ]-?\d{7})-?[A-Z](?![\w-])"), (dni, nie), False),  # mod 23
    ("national_id", re.compile(r"\b[A-Z]{3}[ABCFGHJLPTK][A-Z]\d{4}[A-Z]\b"), (pan,), False),  # holder type, 4th
    ("national_id", re.compile(r"\b[A-Z]{6}[\dLMNP-V]{2}[A-EHLMPR-T][\dLMNP-V]{2}[A-Z][\dLMNP-V]{3}[A-Z]\b"),
     (codicefiscale,), False),  # check letter; digits may be letters (omocodia)
    ("national_id", re.compile(r"\b[A-Z][AEIOUX][A-Z]{2}\d{6}[HMX][A-Z]{5}[\dA-Z]\d\b"), (curp,), False),
    # IBAN (mod 97 and each country's length) and VAT (country prefix, then its own check) are written in groups:
    # the shape may run on into the next capitalised word ("... 0123 456 PER FAVORE"), so it is cut back at a
    # separator until valid
    ("iban", re.compile(r"\b[A-Z]{2}\d{2}(?:[ ]?[A-Z0-9]){11,30}\b"), (iban,), True),
    ("company_id", re.compile(rf"\b(?:{_EU_VAT})(?:[ .-]?[A-Z0-9]){{8,12}}\b"), (vat,), True),
)
# Where an identifier may stand: a run of capitals, digits and separators, 9 characters or more (the shortest
# shape, a DNI's), holding a digit. The patterns above are tried there only: twelve scans of a whole request cost
# ~130 µs per KB-sized request, the runs' one scan ~15 (bench/redact_bench.py).
_ID_RUN = re.compile(r"[0-9A-Z][0-9A-Z ./-]{8,}")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _valid_id(text: str, validators, trim: bool) -> int:
    """How much of the candidate `text` a validator accepts: its length, a shorter piece ending before one of its
    separators (`trim`), or 0."""
    ends = [len(text)] + ([i for i in range(len(text) - 1, 0, -1) if text[i] in " .-"] if trim else [])
    return next((end for end in ends if any(v.is_valid(text[:end]) for v in validators)), 0)


def _ipv6(text: str) -> bool:
    """A valid IPv6 address of three groups or more: a slice (`x[1::2]`) or a ratio is none."""
    try:
        ipaddress.IPv6Address(text.split("%", 1)[0])
    except ValueError:
        return False
    groups = text.split("%", 1)[0].split(":")
    return sum(bool(g) for g in groups) + ("." in groups[-1]) >= 3  # an IPv4 tail holds two groups


def _ipv4(text: str, start: int, end: int) -> bool:
    """A valid dotted quad at text[start:end] that is no version (_VERSION_BEFORE and the patterns beside it)."""
    try:
        ipaddress.IPv4Address(text[start:end])
    except ValueError:
        return False
    before = text[max(0, start - 80):start]
    if _VERSION_BEFORE.search(before) or (_FILE_BEFORE.search(before) and _FILE_AFTER.match(text, end)):
        return False
    return not (_PIN_BEFORE.search(before) and text[end:end + 1] != ":" and not _LOGIN_BEFORE.search(before))


def _order_id(text: str, start: int) -> bool:
    """Whether the SSN-shaped number at `start` follows an order-ish word, and no personal word: an order's id."""
    before = text[max(0, start - 60):start]
    return bool(_ORDER_BEFORE.search(before)) and not _PERSONAL_BEFORE.search(before)


class Redactor:
    """`redact(text)` -> (text with each finding replaced by `[KIND]`, Counter of kinds). `phone_region`: where a
    number written without its country code (+1, +44) is read as from; a number is a phone number only when
    valid there (or valid with the code it carries)."""

    def __init__(self, phone_region: str = "US"):
        self.phone_region = phone_region.upper()

    def spans(self, text: str) -> list[tuple[str, int, int]]:
        found = [(_SECRET_KINDS.get(kind, "api_key"), a, b) for kind, a, b in secret_spans(text)]
        digits = any(c.isdigit() for c in text)
        # before phone and card numbers: at the same span, the identifier's kind is the one counted
        for run in _ID_RUN.finditer(text) if digits else ():
            if any(c.isdigit() for c in run.group()):
                for kind, pattern, validators, trim in _IDS:
                    # from the run's start (lookbehinds still see the text before it) to 2 characters past its end,
                    # all that the patterns' lookaheads read
                    for m in pattern.finditer(text, run.start(), run.end() + 2):
                        if validators == (ssn,) and _order_id(text, m.start()):
                            continue
                        if end := _valid_id(m.group(), validators, trim):
                            found.append((kind, m.start(), m.start() + end))
        found += [("email", m.start(), m.end()) for m in _EMAIL.finditer(text)]
        found += [("ip_address", m.start(), m.end()) for m in _IPV4.finditer(text) if _ipv4(text, m.start(), m.end())]
        found += [("ip_address", m.start(), m.end()) for m in _IPV6.finditer(text) if _ipv6(m.group())]
        found += [("credit_card", m.start(), m.end()) for m in _CARD.finditer(text)
                  if _luhn(re.sub(r"[ -]", "", m.group()))]
        if digits:
            found += [("phone", m.start, m.end) for m in phonenumbers.PhoneNumberMatcher(
                text, self.phone_region, leniency=phonenumbers.Leniency.VALID)]
        # a URL's credential is one finding: what lies in it (a token, the `PASS@host` an e-mail pattern reads) is
        # not found again, and its host is kept
        creds = [("url_credential", m.start(1), m.end(1)) for m in _URL_USERINFO.finditer(text)]
        if creds:
            found = [f for f in found if not any(f[1] < b and a < f[2] for _, a, b in creds)] + creds
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
