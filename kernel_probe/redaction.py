"""What the probe never shows: secrets in the environment, the command line and the
reasons a rank ended, wherever they are shown (the ``env`` and ``process`` tables, and
a dump's copies of them and of its ``reason`` rows). The rules are listed, with examples,
in docs/security-redaction.md; change both together.

Why here and not only by variable name: a secret is often a *value* under an ordinary
name (``DATABASE_URL=postgres://admin:hunter2@db/x``, ``PIP_INDEX_URL`` with a token in it,
``--password hunter2`` on the command line). Three rules, applied in this order:

1. a variable whose name is a secret's (``secret_name``) shows ``<redacted>`` instead of
   its value;
2. in any value and any argument, the credentials of a URL (``scheme://user:password@``,
   ``scheme://token@``) and the values of secret-named query parameters
   (``?token=...``, ``&api_key=...``) are replaced by ``<redacted>``;
3. on a command line, the value of a secret-named option (``--password x``,
   ``--password=x``, ``--hf-token x``, ``--api-key=x``) is replaced, and so is the value of
   a ``NAME=value`` argument whose NAME is a secret's.

Redaction is best effort by shape: a secret passed as a bare positional argument, or under
a name these rules do not know, is shown as given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

REDACTED = "<redacted>"

# Words that make a variable's name a secret's (anywhere in the name, any case).
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH", "COOKIE", "SESSION",
                "PRIVATE")
# Names that hold a secret without saying so: the clients that read them.
KNOWN_SECRET_VARIABLES = frozenset({
    "MYSQL_PWD",            # MySQL clients' password
    "PGPASSWORD",           # PostgreSQL (also matched by PASSWORD)
    "SENTRY_DSN",           # the DSN's key is the credential
    "DD_API_KEY", "DATADOG_API_KEY",
    "NETRC",                # a netrc's contents, when passed inline
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "NEPTUNE_API_TOKEN", "COMET_API_KEY",
    "GITHUB_PAT", "GH_PAT", "NPM_TOKEN", "PYPI_TOKEN", "TWINE_PASSWORD",
    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN",
    "SLACK_WEBHOOK_URL", "DISCORD_WEBHOOK_URL",  # the URL itself is the credential
})
_SECRET_NAME = re.compile("|".join(SECRET_WORDS) + r"|_PWD\Z|(?:\A|_)PASS(?:\Z|_)|(?:\A|_)DSN\Z|WEBHOOK",
                          re.IGNORECASE)
# A URL's userinfo: scheme://user:password@ or scheme://token@ (a password's '@' is %40 in a URL).
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/@:?#]*)"
                           r"(?::(?P<password>[^\s/@?#]*))?@")
_QUERY_WORDS = r"token|password|passwd|pwd|secret|key|signature|sig|auth|credential"
_SECRET_QUERY = re.compile(rf"(?P<head>[?&;][^=&;\s#]*(?:{_QUERY_WORDS})[^=&;\s#]*=)[^&;\s#]+", re.IGNORECASE)
# Options whose value is a secret: the option's name ends with one of these.
_SECRET_OPTION = re.compile(r"\A--?[A-Za-z0-9_.\-]*?(?:password|passwd|pwd|passphrase|token|secret|"
                            r"api[-_]?key|access[-_]?key|secret[-_]?key|private[-_]?key|credentials?)\Z",
                            re.IGNORECASE)
_ASSIGNMENT = re.compile(r"\A(?P<name>[A-Za-z_][A-Za-z0-9_]*)=")


def secret_name(name: str) -> bool:
    """True when a variable (or ``NAME=value`` argument) named ``name`` holds a secret."""
    return name.upper() in KNOWN_SECRET_VARIABLES or _SECRET_NAME.search(name) is not None


def redact_text(text: str) -> str:
    """``text`` with URL credentials and secret-named query parameters replaced (rule 2)."""
    if "://" not in text and "=" not in text:
        return text

    def userinfo(m: re.Match) -> str:
        if m.group("password") is not None:  # the user is shown: who, not how
            return f"{m.group('scheme')}{m.group('user')}:{REDACTED}@"
        return f"{m.group('scheme')}{REDACTED}@"  # a lone userinfo is a token (Sentry's DSN, GitHub's)

    text = _URL_USERINFO.sub(userinfo, text)
    return _SECRET_QUERY.sub(lambda m: m.group("head") + REDACTED, text)


def redact_env(name: str, value: str) -> str:
    """A variable's value as shown (rules 1 and 2)."""
    return REDACTED if secret_name(name) else redact_text(value)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line as shown (rules 2 and 3)."""
    out: list[str] = []
    hide_next = False
    for arg in map(str, argv):
        if hide_next and not (arg.startswith("-") and len(arg) > 1):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        option, eq, _value = arg.partition("=")
        if option.startswith("-") and _SECRET_OPTION.match(option):
            if eq:
                out.append(f"{option}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        m = _ASSIGNMENT.match(arg)
        if m and secret_name(m.group("name")):
            out.append(f"{m.group('name')}={REDACTED}")
            continue
        out.append(redact_text(arg))
    return out
