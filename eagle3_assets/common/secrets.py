"""What a secret looks like, by name and by value, so that none is ever taken into a run config, a pod spec or a
message. Standard library only: the control plane and the worker both read it.

A run config is shown by the UI and kept in the run's record; a pod spec is readable by anyone who can get pods;
a failure message goes to the event log and the compute logs. A secret belongs in the host's environment (a host's
`env` given as dg.EnvVar, or its shell profile) or a Kubernetes Secret, and reaches the worker from there.
"""

from __future__ import annotations

import math
import re
from collections import Counter

# Environment names under which a value is a secret whatever it looks like (HF_TOKEN, WANDB_API_KEY, WANDB_KEY,
# HF_AUTH, AWS_SECRET_ACCESS_KEY); TOKENIZERS_PARALLELISM is not one. A name for where a secret lies (HF_HUB_TOKEN_PATH,
# SSH_KEY_FILE, and the standard ones below) holds a path, the safe way this module's refusals advise, but only a value
# that looks like a path passes under it: `API_KEY_FILE: hunter2-Deploy!` is the secret itself.
SECRET_NAME = re.compile(r"TOKEN(?!IZ)|SECRET|PASSW|PASSPHRASE|API_?KEY|(^|_)KEY(_|$)|(^|_)AUTH(_|$)|CREDENTIAL"
                         r"|PRIVATE|COOKIE", re.IGNORECASE)
PATH_NAME = re.compile(r"_(PATH|FILE|DIR)$", re.IGNORECASE)
# Standard variables that name a secret's file or socket, not the secret (Google's key file, ssh-agent's socket)
PATH_HOLDERS = frozenset({"GOOGLE_APPLICATION_CREDENTIALS", "SSH_AUTH_SOCK", "CLOUDSDK_AUTH_CREDENTIAL_FILE_OVERRIDE"})
# A path: no spaces, quotes, '!' or '$'; with a '/', a leading '~' or '.', or a file extension
_PATH = re.compile(r"[\w.~@+:/-]+")
_PATHLIKE = re.compile(r"/|^[~.]|\.[A-Za-z0-9]{1,10}$")

# Values that are secrets wherever they stand: the kind, then the pattern. Prefixes as the issuers document them.
_KINDS: tuple[tuple[str, re.Pattern], ...] = (
    ("a private key (PEM block)", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?(-----END [A-Z0-9 ]*"
                                             r"PRIVATE KEY-----|$)")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{20,}")),
    ("an API key (sk-...)", re.compile(r"\bsk-[A-Za-z0-9_-]{16,}")),
    ("a GitHub token", re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    ("an AWS access key id", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    ("a bearer token", re.compile(r"\bBearer\s+[A-Za-z0-9._~+/=-]{16,}", re.IGNORECASE)),
)
# A long run of token characters. A model name or a path is short words joined by '-', '_', '/' or '.'; a token is
# one long random piece with lower and upper case and digits (all-hex digests and ids are left alone: by name only).
_TOKEN_RUN = re.compile(r"[A-Za-z0-9+/=_.-]{24,}")
_SEPARATORS = re.compile(r"[+/=_.-]")
_WORD = re.compile(r"[A-Z][a-z]{3,}|[a-z]{5,}")
MIN_PIECE = 16
MIN_BITS_PER_CHAR = 3.5  # 16+ random base62 characters measure 3.7-4.6; a repeated piece less


def _bits_per_char(s: str) -> float:
    counts, n = Counter(s), len(s)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def _random_token(run: str) -> bool:
    if run.count("/") >= 2:  # a path (base64 has a '/' every ~64 characters): its parts are names
        return False
    pieces = _SEPARATORS.split(run)
    # base64 and url-safe tokens hold a separator every ~32 characters, names one every few: judge a token whole
    piece = "".join(pieces) if len(run) / len(pieces) >= 9 else max(pieces, key=len)
    classes = sum(bool(re.search(p, piece)) for p in ("[a-z]", "[A-Z]", "[0-9]"))
    # LlamaForCausalLMEagle3 or HuggingFaceH4ultrachat is a name: most of it words (random tokens: 47 % at p99)
    named = sum(len(w) for w in _WORD.findall(piece)) / max(len(piece), 1) >= 0.55
    return len(piece) >= MIN_PIECE and classes == 3 and not named and _bits_per_char(piece) >= MIN_BITS_PER_CHAR


def secret_kind(value: str) -> str | None:
    """What kind of secret `value` holds or contains, in words; None when it looks like none."""
    for kind, pattern in _KINDS:
        if pattern.search(value):
            return kind
    if any(_random_token(m.group()) for m in _TOKEN_RUN.finditer(value)):
        return "a long random token"
    return None


def looks_like_path(value: str) -> bool:
    """An absolute or relative file path (/secrets/sa.json, ~/.hf/token, token.txt), not a secret of its own."""
    return bool(_PATH.fullmatch(value)) and bool(_PATHLIKE.search(value)) and secret_kind(value) is None


def holds_path(name: str) -> bool:
    """A name for where a secret lies: *_PATH, *_FILE, *_DIR, or a standard one (GOOGLE_APPLICATION_CREDENTIALS)."""
    return bool(PATH_NAME.search(name)) or name.upper() in PATH_HOLDERS


def secret_name(name: str, value: str | None = None) -> bool:
    """Whether `value` under environment name `name` is a secret by its name: a secret's name, unless the name is
    one for where a secret lies and the value (when given) looks like a path."""
    if not SECRET_NAME.search(name):
        return False
    return not holds_path(name) or (value is not None and not looks_like_path(value))


# In messages only (a command's output, a URL), whatever the value looks like. The name kept (group 1), the value
# replaced: what an option named as a secret is given (--token=..., --password Winter-2026!, PGPASSWORD=...), a
# long hex or base64 run said beside such a word (token: 5e0c9a7b...), a URL's user:password@ with a scheme or
# without (svc:pw@10.0.0.5:8000). A value already replaced is left as it is: scrubbing twice changes nothing.
_SECRET_WORD = r"(?:token|secret|passw(?:or)?d|passphrase|pwd|api[-_]?key|access[-_]?key|key|auth|credentials?)"
_VALUE = r"(?!\[[^\]]*not shown\])(?:\"[^\"\n]*\"|'[^'\n]*'|[^\s'\",]+)"
_IN_MESSAGES: tuple[tuple[str, re.Pattern], ...] = (
    ("a secret", re.compile(rf"((?<![\w-])--?[\w-]*{_SECRET_WORD}(?:=|[ \t]+(?!-)))" + _VALUE, re.I)),
    ("a secret", re.compile(rf"((?<![\w-])[A-Za-z_]*{_SECRET_WORD}=)" + _VALUE, re.I)),
    ("a secret", re.compile(rf"(\b{_SECRET_WORD}\b[\"']?[ \t]*[:=]?[ \t]*[\"']?)"
                            r"(?![^\s]*not shown\])(?=[A-Za-z0-9+/_-]*[0-9])([A-Fa-f0-9]{16,}|[A-Za-z0-9+/_-]{20,}={0,2})"
                            r"(?![\w+/=-])", re.I)),
    ("a URL's credentials", re.compile(r"(://)(?!\[[^\]]*not shown\])[^\s/@:'\"]+:[^\s/@'\"]+(?=@)")),
    ("a URL's credentials", re.compile(r"((?<![\w.+/:@-])[A-Za-z][\w.+-]*:)(?!//)(?!\[[^\]]*not shown\])"
                                       r"[^\s/@:'\"]+(?=@[\w.-])")),)


def scrub(text: str) -> str:
    """`text` with every secret-looking part replaced by what it is: for messages built from what a user gave."""
    for kind, pattern in _IN_MESSAGES:
        text = pattern.sub(rf"\1[{kind}, not shown]", text)
    for kind, pattern in _KINDS:
        text = pattern.sub(f"[{kind}, not shown]", text)
    return _TOKEN_RUN.sub(lambda m: "[a long random token, not shown]" if _random_token(m.group()) else m.group(),
                          text)


def secret_spans(text: str) -> list[tuple[str, int, int]]:
    """(kind, start, end) of each secret-looking part of `text`, kinds in `secret_kind`'s words; spans of two kinds
    may overlap. For a redactor that counts what it removed (eagle3_assets/sources/redact.py)."""
    spans = [(kind, m.start(), m.end()) for kind, pattern in _KINDS for m in pattern.finditer(text)]
    return spans + [("a long random token", m.start(), m.end()) for m in _TOKEN_RUN.finditer(text)
                    if _random_token(m.group())]


WHERE_SECRETS_GO = ("a secret never goes in a run config (the UI shows it and the run's record keeps it): set it in "
                    "the host's environment instead (the host resource's `env`, given as dg.EnvVar(\"NAME\"), or the "
                    "host's shell profile), or for a k8s host a Kubernetes Secret listed under `secrets`; the worker "
                    "and the engine servers it starts inherit it")


def find_secrets(value, where: str = "", names: bool = True) -> list[str]:
    """Every place in a config value (nested dicts and lists) that holds a secret, each as 'where: why' (never the
    value itself): by value, and with `names` by the key it stands under (an environment mapping's names)."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            at = f"{where}.{k}" if where else str(k)
            if names and isinstance(v, str) and v and secret_name(str(k), v):
                found.append(f"{at}: " + ("its name says it holds a secret's path, but its value is not a path"
                                          if holds_path(str(k)) else "its name says it is a secret"))
            else:
                found += find_secrets(v, at)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found += find_secrets(v, f"{where}[{i}]")
    elif isinstance(value, str):
        kind = secret_kind(value)
        if kind:
            found.append(f"{where or '(value)'}: looks like {kind}")
    return found
