"""A character-level FSM (interegular) used to find the text a regex forces next."""

from __future__ import annotations

from typing import NamedTuple

import interegular
from interegular.fsm import anything_else

_MAX_FORCED_CHARS = 256


class CharState(NamedTuple):
    """Where the char FSM is: its state (None once lost) and bytes of an unfinished char."""

    state: int | None
    pending: bytes


class CharFSM:
    """interegular's DFA for one regex, with dead states pruned, walked over UTF-8 bytes."""

    def __init__(self, regex: str) -> None:
        fsm = interegular.parse_pattern(regex).to_fsm()
        self._map: dict[int, dict[int, int]] = {s: dict(t) for s, t in fsm.map.items()}
        self._finals = frozenset(fsm.finals)
        self._alphabet = fsm.alphabet
        self._live = self._live_states(fsm.states)
        self.initial = CharState(fsm.initial if fsm.initial in self._live else None, b"")

    def _live_states(self, states: set[int]) -> frozenset[int]:
        live = set(self._finals)
        changed = True
        while changed:
            changed = False
            for state in states:
                if state not in live and any(n in live for n in self._map.get(state, {}).values()):
                    live.add(state)
                    changed = True
        return frozenset(live)

    def advance(self, at: CharState, data: bytes) -> CharState:
        """Feed raw token bytes; complete characters move the FSM, a partial tail waits."""
        if at.state is None:
            return at
        buffer = at.pending + data
        cut = _complete_utf8_len(buffer)
        try:
            text = buffer[:cut].decode("utf-8")
        except UnicodeDecodeError:
            return CharState(None, b"")
        state: int | None = at.state
        for char in text:
            state = self._step(state, char)
            if state is None:
                break
        return CharState(state, buffer[cut:] if state is not None else b"")

    def _step(self, state: int, char: str) -> int | None:
        key = self._alphabet[char]
        nxt = self._map.get(state, {}).get(key)
        return nxt if nxt in self._live else None

    def forced_string(self, at: CharState) -> str:
        """The characters every match must continue with from `at` ("" if none or unknown)."""
        if at.state is None or at.pending:
            return ""
        state, chars = at.state, []
        while state not in self._finals and len(chars) < _MAX_FORCED_CHARS:
            moves = [(k, n) for k, n in self._map.get(state, {}).items() if n in self._live]
            if len(moves) != 1:
                break
            key, state = moves[0]
            symbols = self._alphabet.by_transition[key]
            if len(symbols) != 1 or symbols[0] is anything_else:
                break
            chars.append(symbols[0])
        return "".join(chars)


def _complete_utf8_len(data: bytes) -> int:
    """Length of the prefix of `data` that does not end inside a UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for the lead byte
        if byte & 0x80 == 0:
            return len(data)
        needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
        return len(data) if back >= needed else len(data) - back
    return len(data)
