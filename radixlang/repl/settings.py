"""The session's sampling settings, changed with ``/set KEY VALUE``: each value is checked here,
so a bad one is a message naming the key, never a request the engine refuses later."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class SettingError(ValueError):
    """A ``/set`` key or value that is not valid; the message says what is expected."""


@dataclass
class Settings:
    temperature: float = 0.7
    max_tokens: int = 256
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None  # None: a fresh draw every request
    system: str | None = None  # None: the chat template's own default, if any
    ignore_eos: bool = False  # go on past the end-of-sequence token, to max_tokens

    def sampling(self) -> dict[str, Any]:
        """Sampling parameters in the engine's names: a chat turn's, and ``/run``'s defaults
        (what a program's gens leave unset)."""
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "max_new_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.seed is not None:
            out["seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def set(self, key: str, raw: str) -> Any:
        """Parse ``raw`` for ``key`` and store it; returns the stored value."""
        parse = _PARSERS.get(key)
        if parse is None:
            raise SettingError(f"unknown setting {key!r}: one of {', '.join(SETTING_NAMES)}")
        value = parse(key, raw.strip())
        setattr(self, key, value)
        return value


def _number(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{key} must be a number, got {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingError(f"{key} must be finite, got {raw!r}")
    return value


def _integer(key: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{key} must be an integer, got {raw!r}") from None


def _temperature(key: str, raw: str) -> float:
    value = _number(key, raw)
    if value < 0:
        raise SettingError(f"temperature must be >= 0 (0: greedy), got {raw}")
    return value


def _max_tokens(key: str, raw: str) -> int:
    value = _integer(key, raw)
    if value < 1:
        raise SettingError(f"max_tokens must be >= 1, got {raw}")
    return value


def _top_p(key: str, raw: str) -> float:
    value = _number(key, raw)
    if not 0 < value <= 1:
        raise SettingError(f"top_p must be in (0, 1], got {raw}")
    return value


def _top_k(key: str, raw: str) -> int:
    value = _integer(key, raw)
    if value < -1:
        raise SettingError(f"top_k must be >= 1, or -1 or 0 for off, got {raw}")
    return -1 if value == 0 else value


def _seed(key: str, raw: str) -> int | None:
    if raw.lower() in ("none", "off", ""):
        return None
    value = _integer(key, raw)
    if value < 0:
        raise SettingError(f"seed must be >= 0 (or 'none'), got {raw}")
    return value


def _boolean(key: str, raw: str) -> bool:
    words = {"on": True, "true": True, "yes": True, "1": True,
             "off": False, "false": False, "no": False, "0": False}  # fmt: skip
    if raw.lower() not in words:
        raise SettingError(f"{key} is on or off, got {raw!r}")
    return words[raw.lower()]


def _system(key: str, raw: str) -> str | None:
    return None if raw.lower() in ("", "none", "default") else raw


_PARSERS = {
    "temperature": _temperature,
    "max_tokens": _max_tokens,
    "top_p": _top_p,
    "top_k": _top_k,
    "seed": _seed,
    "system": _system,
    "ignore_eos": _boolean,
}
SETTING_NAMES = tuple(_PARSERS)
