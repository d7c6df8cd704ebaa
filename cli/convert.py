"""`hybridpd convert`: Mamba conv state between SD and DS layouts, and across TP sizes."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from ._options import MAX_SPEC_TOKENS, MAX_TP, BoundedInt, ModelArg
from ._output import Report, Table, emit_json, emit_report, fmt_bytes, hint, output_options, resolve_format


class _Layout(click.ParamType):
    """DS or SD, any case."""

    name = "[DS|SD]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        v = str(value).upper()
        if v not in ("DS", "SD"):
            self.fail(f"{value!r} is not DS or SD", param, ctx)
        return v


LAYOUT = _Layout()
_MAX_ROWS = 40


@contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """SIGTERM / SIGHUP end the conversion like Ctrl-C: the writers' abort paths remove their temporary
    files, then the process exits 128 + signal number (only SIGKILL can leave a temporary behind)."""
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@click.command()
@click.argument("input_path", metavar="INPUT", type=click.Path())
@click.argument("output_path", metavar="OUTPUT", type=click.Path())
@click.option("--to", "to", type=LAYOUT, default=None,
              help="Conv layout to write: DS (dim, state_len) or SD (state_len, dim). Required unless --check.")
@click.option("--from", "from_layout", type=LAYOUT, default=None,
              help="Layout of INPUT's conv states when neither its metadata nor --model can tell.")
@click.option("--model", type=ModelArg(), default=None,
              help="Recognise conv/SSM states by shape (same MODEL resolution as `plan`). Needed to split/merge "
                   "files that do not record the model's dims.")
@click.option("--num-speculative-tokens", "num_spec", type=BoundedInt(0, MAX_SPEC_TOKENS), default=0, show_default=True,
              help="Speculative tokens the engine ran with (state_len = conv_kernel - 1 + this).")
@click.option("--pattern", default=None,
              help="Regex for conv state tensor names (default: 'conv', or the file's recorded list).")
@click.option("--tp-split", type=BoundedInt(2, MAX_TP), default=None,
              help="Write N per-rank files (x, B, C and SSM heads sliced as vLLM shards them).")
@click.option("--tp-merge", is_flag=True, help="Merge per-rank files (a directory or a {rank} template) into one.")
@click.option("--check", is_flag=True,
              help="Verify an existing OUTPUT against INPUT (SD vs DS, or a full state vs its shards); "
                   "exit 1 at the first mismatch.")
@click.option("--force", is_flag=True, help="Overwrite existing outputs (never the input).")
@click.option("--device", default="cpu", show_default=True, help="Where the transposes run: cpu, cuda or cuda:N.")
@click.option("--checksum", type=click.Choice(["xxh3", "crc32", "sha256", "none"]), default="xxh3", show_default=True,
              help="Checksum of every input's and output's tensor data, in --json and the output's metadata "
                   "(sha256 for content identity; costs more CPU).")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when a terminal).")
@click.option("--allow-network", is_flag=True, help="Let MODEL resolution fetch config.json from the Hub.")
@output_options
def convert(input_path: str, output_path: str, to: str | None, from_layout: str | None, model: str | None,
            num_spec: int, pattern: str | None, tp_split: int | None, tp_merge: bool, check: bool, force: bool,
            device: str, checksum: str, progress: bool | None, allow_network: bool, as_json: bool,
            fmt: str | None) -> None:
    """Convert Mamba2 conv state snapshots (safetensors) between SD and DS layouts, and across TP.

    INPUT and OUTPUT are .safetensors files or directories of them. Tensors named by --pattern are
    conv states; with --model they are also recognised by shape, and SSM states (heads, head_dim,
    state) are found for --tp-split/--tp-merge. Other tensors and metadata are copied; the output
    records its layout in `hybridpd.*` metadata. Outputs appear atomically; INPUT is never modified.

    \b
    Examples:
      hybridpd convert state.safetensors state.ds.safetensors --to DS --model nano
      hybridpd convert state.safetensors shards/ --to DS --model nano --tp-split 4
      hybridpd convert --tp-merge shards/ full.safetensors --to SD
      hybridpd convert --check state.safetensors shards/ --json
    """
    from hybridpd.convert.run import ConvertOptions
    from hybridpd.convert.run import check as run_check
    from hybridpd.convert.run import convert as run_convert
    from hybridpd.errors import VerificationFailed

    opts = ConvertOptions(to=to, model=model, num_spec=num_spec, pattern=pattern,
                          from_layout=from_layout, tp_split=tp_split, tp_merge=tp_merge, force=force, device=device,
                          checksum=checksum, allow_network=allow_network)
    out = resolve_format(as_json, fmt)
    show = sys.stderr.isatty() if progress is None else progress
    with _terminate_cleanly(), _progress(show, "checking" if check else "converting") as bar:
        if check:
            result = run_check(input_path, output_path, opts, progress=bar)
            data = result.to_dict()
        else:
            data = run_convert(input_path, output_path, opts, progress=bar).to_dict()
    if out == "json":
        emit_json(data)
    else:
        emit_report(_render_check(data) if check else _render(data), out)
    for note in data.get("notes", []):
        hint(f"note: {note}")
    if check and not data["ok"]:
        m = data["first_mismatch"]
        raise VerificationFailed(f"{m['file']}: tensor {m['tensor']!r}: {m['reason']}"
                                 + (f" at index {m['index']}" if m.get("index") is not None else ""),
                                 fix="reconvert, or check --model / --num-speculative-tokens")


@contextmanager
def _progress(show: bool, label: str) -> Iterator[Callable[[int, int], None] | None]:
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(f"[bold]{label}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            prog.update(task, completed=done, total=total)

        yield update


def _short(checksum: str | None) -> str:
    return checksum[:23] if checksum else "-"


def _render(d: dict[str, Any]) -> Report:
    files = Table(title=f"{d['operation']}: conv layout {', '.join(d['layout_before']) or '-'} -> {d['layout_after']}",
                  headers=["", "file", "conv layout", "TP", "rank", "size", "data checksum"],
                  rows=[[role, f["path"], f["conv_layout"] or "-", f["tp_size"], f["tp_rank"], fmt_bytes(f["bytes"]),
                         _short(f["data_checksum"])] for role, key in (("in", "inputs"), ("out", "outputs"))
                        for f in d[key]])
    rows = [[t["name"], t["kind"], t["action"], t["dtype"], _shape(t["shape_in"]), _shape(t["shape_out"])]
            for t in d["tensors"][:_MAX_ROWS]]
    more = len(d["tensors"]) - _MAX_ROWS
    tensors = Table(title="Tensors", headers=["tensor", "kind", "action", "dtype", "shape in", "shape out"],
                    rows=rows, caption=f"... {more} more (--json lists all)" if more > 0 else None)
    speed = f" ({fmt_bytes(d['bytes_per_second'])}/s)" if d["bytes_per_second"] else ""
    note = (f"{d['tensors_converted']} of {d['tensors_total']} tensors converted ({d['conv_tensors']} conv, "
            f"{d['ssm_tensors']} SSM); read {fmt_bytes(d['bytes_read'])}, wrote {fmt_bytes(d['bytes_written'])} "
            f"in {d['seconds']:.2f} s{speed} on {d['device']}")
    return Report(tables=[files, tensors], notes=[note])


def _shape(s: list[Any]) -> str:
    if s and isinstance(s[0], list):
        return " | ".join("x".join(map(str, x)) for x in s)
    return "x".join(map(str, s))


def _render_check(d: dict[str, Any]) -> Report:
    pairs = Table(title="check", headers=["reference", "compared", "kind", "tensors", "bytes", "layouts", "ok"],
                  rows=[[p["reference"], "\n".join(p["compared"]), p["kind"], p["tensors"], fmt_bytes(p["bytes"]),
                         f"{','.join(p['layout_reference']) or '-'} vs {','.join(p['layout_compared']) or '-'}",
                         p["ok"]] for p in d["pairs"]])
    notes = [f"OK: {fmt_bytes(d['bytes_compared'])} compared in {d['seconds']:.2f} s, no difference"] if d["ok"] else []
    m = d["first_mismatch"]
    if m:
        vals = ""
        if m.get("expected_hex") is not None:
            vals = (f"; expected {m['expected']} (0x{m['expected_hex']}), found {m['actual']} (0x{m['actual_hex']})")
        idx = f" at index {m['index']}" if m.get("index") is not None else ""
        notes.append(f"FIRST MISMATCH: {m['file']}: tensor {m['tensor']!r}{idx}: {m['reason']}{vals}")
    return Report(tables=[pairs], notes=notes)
