"""What the Responses and Conversations APIs keep on disk in --file-storage-path: stored
responses (`ResponseFiles`: `responses/<id>.json`, each whole) and, for both, which response
or conversation holds an item (`ItemIndex`: `items.jsonl` in their folder), so that an
`item_reference` finds an item whose holder is no longer in memory, or was stored by a
server since restarted on the folder."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # (responses_api.new_id's)
# OpenAI keeps a stored response 30 days: so does the folder, from when it was last written
RESPONSE_RETENTION_S = 30 * 24 * 3600
SWEEP_INTERVAL_S = 3600


class ItemIndex:
    """Item id → the id of the response or conversation that took it last, as lines of
    `[item id, holder id]` appended to one file and read whole at start, when the entries
    of holders no longer kept (`kept` says which are) are dropped and a line a kill or a
    full disk cut off with them: the file is then written again, whole. An entry may still
    be stale (the item deleted from its holder, or the holder since): a reader checks the
    holder has it."""

    def __init__(self, path: Path, kept: Callable[[str], bool]) -> None:
        self.path = path
        self.holders: dict[str, str] = {}
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        whole = data.endswith(b"\n") or not data
        for raw in data.splitlines():
            try:
                item_id, holder = json.loads(raw)
            except (ValueError, TypeError):
                whole = False  # (a cut-off line)
                continue
            if isinstance(item_id, str) and isinstance(holder, str):
                self.holders[item_id] = holder
        lines = len(self.holders)
        alive = {h for h in set(self.holders.values()) if kept(h)}  # (each holder once)
        self.holders = {i: h for i, h in self.holders.items() if h in alive}
        self.whole = True  # the file ends with a whole line
        if not whole or len(self.holders) < lines or data.count(b"\n") > lines:
            self._rewrite()

    def add(self, item_ids: list[str], holder: str) -> None:
        fresh = [i for i in item_ids if self.holders.get(i) != holder]
        if not fresh:
            return
        lines = b"".join(json_line([i, holder]) for i in fresh)
        try:
            with self.path.open("ab") as out:
                out.write(lines if self.whole else b"\n" + lines)  # (after a cut-off line)
        except OSError:  # (a full disk): the items are found while their holder is in memory
            self.whole = False
            logger.exception("the item index %s could not be written", self.path)
            return
        self.whole = True
        self.holders.update(dict.fromkeys(fresh, holder))

    def get(self, item_id: str) -> str | None:
        return self.holders.get(item_id)

    def _rewrite(self) -> None:
        data = b"".join(json_line([i, h]) for i, h in self.holders.items())
        try:
            write_bytes_whole(self.path, data)
        except OSError:
            self.whole = False
            logger.exception("the item index %s could not be rewritten", self.path)


class ResponseFiles:
    """Stored responses on disk, one `<id>.json` each (the response, its own input items,
    the id of the one it continues, and a streamed background response's events), written
    whole when it is stored and again when it changes (a background one: queued, then
    ended); removed 30 days after they were last written, as OpenAI's stored responses
    expire (swept at start and hourly after). A response that was still queued or running
    when its server stopped reads back failed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for partial in folder.glob("*.partial"):  # a write the server did not finish
            partial.unlink(missing_ok=True)
        self.swept_at = 0.0
        self.sweeper: threading.Thread | None = None  # the latest sweep while serving
        self._sweep()
        self.items = ItemIndex(folder / "items.jsonl", self._kept)

    def _kept(self, response_id: str) -> bool:
        path = self.path(response_id)
        return path is not None and path.is_file()

    def _sweep(self) -> None:
        """Remove the responses written last more than RESPONSE_RETENTION_S ago."""
        now = time.time()
        self.swept_at = now
        for path in self.folder.glob("resp_*.json"):
            try:
                if path.stat().st_mtime < now - RESPONSE_RETENTION_S:
                    path.unlink()
            except OSError:  # (gone meanwhile, or not ours to remove: read() skips it)
                pass

    def path(self, response_id: str) -> Path | None:
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        return self.folder / f"{response_id}.json"

    def write(self, record: dict[str, Any], item_ids: list[str]) -> None:
        response_id = record["response"]["id"]
        path = self.path(response_id)
        if path is None:
            return
        if time.time() - self.swept_at > SWEEP_INTERVAL_S:  # (a folder of many files takes
            # a while to list: not on the event loop)
            self.swept_at = time.time()
            self.sweeper = threading.Thread(target=self._sweep, name="responses-sweep")
            self.sweeper.daemon = True
            self.sweeper.start()
        try:
            write_bytes_whole(path, json.dumps(record).encode())
        except OSError:  # (a full disk): it is served on from memory while it stays there,
            # and an older copy on disk (a background one's, queued) is not read back for it
            logger.exception("response %s could not be kept on disk", response_id)
            self.remove(response_id)
            return
        self.items.add(item_ids, response_id)

    def read(self, response_id: str) -> dict[str, Any] | None:
        """The record of a response kept on disk (None: none, expired or unreadable)."""
        path = self.path(response_id)
        if path is None:
            return None
        try:
            if path.stat().st_mtime < time.time() - RESPONSE_RETENTION_S:
                path.unlink()
                return None
            record = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("%s: not a stored response (%s)", path, e)
            return None
        response = record.get("response") if isinstance(record, dict) else None
        if not isinstance(response, dict) or response.get("id") != response_id:
            logger.warning("%s: not a stored response", path)
            return None
        return record

    def remove(self, response_id: str) -> None:
        path = self.path(response_id)
        if path is not None:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                logger.exception("response %s could not be removed from disk", response_id)


def write_bytes_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (written beside it as `<path>.partial`, then
    moved over it; the partial file removed where that fails)."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


def json_line(value: Any) -> bytes:
    """`value` as one line of JSON Lines."""
    return json.dumps(value).encode() + b"\n"
