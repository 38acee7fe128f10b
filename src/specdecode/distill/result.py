"""A distillation's result, DIR/adapter (peft's `save_pretrained`) and DIR/distill.json (what it
was trained for, on and with), written so that only a finished run loads, and read back for a
`distilled:DIR` draft.

Writing (`write_result`): the adapter goes to DIR/.adapter.partial, then any earlier distill.json is
removed, the folder renamed to DIR/adapter, and distill.json (which holds the adapter weights'
SHA-256) written last, by rename. Reading and merging it: models/adapters.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from specdecode.models.adapters import ADAPTER, FORMAT, PARTIAL, RECORD, WEIGHTS
from specdecode.models.fetch import sha256_file
from specdecode.models.files import disk_guard, replace_folder, save_json


def write_result(out: Path, peft_model: Any, record: dict[str, Any]) -> None:
    """DIR/adapter and DIR/distill.json (`record` plus the adapter's hash), in that order."""
    partial, final, record_path = out / PARTIAL, out / ADAPTER, out / RECORD
    if partial.exists():
        shutil.rmtree(partial)
    with disk_guard("the adapter", partial):
        peft_model.save_pretrained(partial)
    record = {**record, "format": FORMAT, "adapter": {**record.get("adapter", {})}}
    record["adapter"]["sha256"] = sha256_file(partial / WEIGHTS)
    if record_path.exists():
        record_path.unlink()  # from here on DIR holds no result that loads, until the last write
    with disk_guard("the adapter", final):
        replace_folder(partial, final)
    save_json(record_path, record, "distill.json")
