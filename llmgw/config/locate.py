"""Where a key of a TOML file is: tomllib reports no positions, so config errors find the line
of a key path (``("models", 1, "replicas", 0, "url")``) by scanning the text themselves. Pure."""

from __future__ import annotations

import re
import tomllib

__all__ = ["TomlLocator", "KeyPath"]

KeyPath = tuple[str | int, ...]


class TomlLocator:
    """Best-effort map from key path to 1-based line, by scanning already-valid TOML text.

    Understands [table] / [[array]] headers (counting occurrences per array), dotted and quoted
    keys, inline tables and arrays (including arrays of inline tables), strings and comments.
    A path not found maps to its nearest recorded ancestor (e.g. a missing key to its table
    header); None when there is none.
    """

    _BARE = re.compile(r"[A-Za-z0-9_-]+")
    _SCALAR = re.compile(r"[^,\]}\n#]+")

    def __init__(self, text: str):
        self.s, self.i, self.line = text, 0, 1
        self.found: dict[KeyPath, int] = {}
        self.aot: dict[KeyPath, int] = {}  # array-of-tables path -> elements seen so far
        try:
            self._document()
        except (IndexError, AttributeError, ValueError, tomllib.TOMLDecodeError):
            pass  # keep what was found so far

    def line_of(self, path: KeyPath) -> int | None:
        for n in range(len(path), 0, -1):
            if (line := self.found.get(path[:n])) is not None:
                return line
        return None

    def _adv(self, n: int = 1) -> None:
        self.line += self.s.count("\n", self.i, self.i + n)
        self.i += n

    def _skip(self, newlines: bool = True) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t\r" or (newlines and c == "\n"):
                self._adv()
            elif c == "#":
                end = self.s.find("\n", self.i)
                self._adv((end if end >= 0 else len(self.s)) - self.i)
            else:
                break

    def _record(self, path: KeyPath, line: int) -> None:
        for n in range(1, len(path) + 1):
            self.found.setdefault(path[:n], line)

    def _document(self) -> None:
        table: KeyPath = ()
        while True:
            self._skip()
            if self.i >= len(self.s):
                return
            line = self.line
            if self.s[self.i] == "[":
                array = self.s.startswith("[[", self.i)
                self._adv(2 if array else 1)
                table = self._resolve(self._key(), array)
                self._record(table, line)
                self._skip(False)
                self._adv(2 if array else 1)
            else:
                path = table + self._key()
                self._record(path, line)
                self._adv()  # '='
                self._value(path)

    def _resolve(self, keys: tuple[str, ...], array: bool) -> KeyPath:
        cur: KeyPath = ()
        for n, key in enumerate(keys):
            cur += (key,)
            if array and n == len(keys) - 1:
                self.aot[cur] = self.aot.get(cur, 0) + 1
                cur += (self.aot[cur] - 1,)
            elif cur in self.aot:
                cur += (self.aot[cur] - 1,)
        return cur

    def _key(self) -> tuple[str, ...]:
        keys = []
        while True:
            self._skip(False)
            if self.s[self.i] in "\"'":
                start = self.i
                self._string()
                keys.append(tomllib.loads(f"k = {self.s[start:self.i]}")["k"])
            else:
                m = self._BARE.match(self.s, self.i)
                keys.append(m.group())
                self._adv(m.end() - self.i)
            self._skip(False)
            if self.s[self.i] != ".":
                return tuple(keys)
            self._adv()

    def _string(self) -> None:
        q = next(q for q in ('"""', "'''", '"', "'") if self.s.startswith(q, self.i))
        self._adv(len(q))
        while not self.s.startswith(q, self.i):
            self._adv(2 if q[0] == '"' and self.s[self.i] == "\\" else 1)
            if self.i >= len(self.s):
                raise ValueError("unterminated string")
        self._adv(len(q))
        for _ in range(2 if len(q) == 3 else 0):  # """a""""" ends with up to two more quotes
            if self.s.startswith(q[0], self.i):
                self._adv()

    def _value(self, path: KeyPath) -> None:
        self._skip(False)
        c = self.s[self.i]
        if c in "\"'":
            self._string()
        elif c in "[{":
            self._adv()
            idx = 0
            while True:
                self._skip()
                if self.s[self.i] in "]}":
                    self._adv()
                    return
                if c == "[":
                    self.found.setdefault(path + (idx,), self.line)
                    self._value(path + (idx,))
                    idx += 1
                else:
                    line = self.line
                    sub = path + self._key()
                    self._record(sub, line)
                    self._adv()  # '='
                    self._value(sub)
                self._skip()
                if self.s[self.i] == ",":
                    self._adv()
        else:
            m = self._SCALAR.match(self.s, self.i)
            self._adv(m.end() - self.i)
