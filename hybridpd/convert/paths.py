"""INPUT/OUTPUT of ``convert`` -> jobs (which source files make which target files).

- layout conversion: file -> file (or into an existing directory), directory -> directory;
- ``--tp-split N``: each source -> N shards, named by a template holding ``{rank}`` (also ``{tp}``,
  ``{stem}``) or ``OUTPUT/<stem>.rank<r>-of-<N>.safetensors``;
- ``--tp-merge``: a ``{rank}`` template, or a directory of ``<stem>.rank<r>-of-<N>.safetensors``
  shards (one merged file per stem), or a directory whose files record ``hybridpd.tp_rank``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hybridpd.convert.header import read_header
from hybridpd.convert.plan import META_TP_RANK
from hybridpd.errors import UsageError

SUFFIX = ".safetensors"
SHARD_RE = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)-of-(?P<tp>\d+)\.safetensors$")


@dataclass(frozen=True, kw_only=True)
class Job:
    sources: tuple[Path, ...]  # one file, or the shards in rank order
    targets: tuple[Path, ...]  # one file, or the shards in rank order


def shard_name(stem: str, rank: int, tp: int) -> str:
    return f"{stem}.rank{rank}-of-{tp}{SUFFIX}"


def _files(d: Path) -> list[Path]:
    files = sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(SUFFIX) and not p.name.startswith("."))
    if not files:
        raise UsageError(f"{d} holds no *.safetensors files", field="INPUT", fix="point INPUT at a file or directory")
    return files


def _stem(p: Path) -> str:
    return p.name[: -len(SUFFIX)] if p.name.endswith(SUFFIX) else p.name


def _is_template(p: str) -> bool:
    return "{rank}" in p


def _template(t: str, *, rank: int, tp: int, stem: str) -> Path:
    try:
        return Path(t.format(rank=rank, tp=tp, stem=stem))
    except (KeyError, IndexError, ValueError) as e:
        raise UsageError(f"bad template {t!r}: {e}", field="OUTPUT",
                         fix="use the fields {rank}, {tp} and {stem}, e.g. out/state.rank{rank}.safetensors") from None


def _existing(path: str, what: str = "INPUT") -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p} does not exist", field=what, fix="check the path")
    return p


def layout_jobs(inp: str, out: str) -> list[Job]:
    src, dst = _existing(inp), Path(out)
    if src.is_file():
        target = dst / src.name if dst.is_dir() else dst
        return [Job(sources=(src,), targets=(target,))]
    if (dst.exists() and not dst.is_dir()) or (not dst.exists() and dst.name.endswith(SUFFIX)):
        raise UsageError(f"INPUT is a directory but OUTPUT {dst} names a file", field="OUTPUT",
                         fix="pass a directory as OUTPUT (or --tp-merge to merge shards into one file)")
    return [Job(sources=(f,), targets=(dst / f.name,)) for f in _files(src)]


def split_jobs(inp: str, out: str, n: int) -> list[Job]:
    src = _existing(inp)
    files = [src] if src.is_file() else _files(src)
    if _is_template(out) and len(files) > 1 and "{stem}" not in out:
        raise UsageError("several INPUT files need {stem} in the OUTPUT template", field="OUTPUT",
                         fix="e.g. shards/{stem}.rank{rank}.safetensors, or pass a directory")
    if not _is_template(out) and (Path(out).is_file() or (not Path(out).exists() and out.endswith(SUFFIX))):
        raise UsageError(f"--tp-split writes {n} files; OUTPUT {out} names one file", field="OUTPUT",
                         fix="pass a directory, or a template holding {rank} (e.g. state.rank{rank}.safetensors)")
    jobs = []
    for f in files:
        stem = _stem(f)
        targets = tuple(_template(out, rank=r, tp=n, stem=stem) if _is_template(out)
                        else Path(out) / shard_name(stem, r, n) for r in range(n))
        jobs.append(Job(sources=(f,), targets=targets))
    return jobs


def shard_sets(inp: str) -> list[tuple[str, tuple[Path, ...]]]:
    """(stem, shards in rank order) for a ``{rank}`` template or a directory of shards."""
    if _is_template(inp):
        if "{stem}" in inp:
            raise UsageError("a --tp-merge INPUT template takes {rank} (and {tp}), not {stem}", field="INPUT",
                             fix="e.g. shards/state.rank{rank}-of-{tp}.safetensors")
        tps = [t for t in range(2, 1025) if _template(inp, rank=0, tp=t, stem="").exists()] if "{tp}" in inp else [0]
        found: list[Path] = []
        while len(tps) == 1 and (p := _template(inp, rank=len(found), tp=tps[0], stem="")).exists():
            found.append(p)
            if len(found) == tps[0]:
                break
        if len(tps) != 1 or not found or (tps[0] and len(found) != tps[0]):
            raise UsageError(f"no complete shard set matches {inp} (found {len(found)} shards)", field="INPUT",
                             fix="check the template; every rank 0..N-1 must exist")
        return [(_stem(found[0]).replace(".rank0", ""), tuple(found))]
    d = _existing(inp)
    if not d.is_dir():
        raise UsageError(f"{d} is one file; shards come as a directory or a {{rank}} template", field="INPUT",
                         fix="e.g. hybridpd convert --tp-merge shards/ full.safetensors --to SD")
    groups: dict[tuple[str, int], dict[int, Path]] = {}
    loose = []
    for f in _files(d):
        m = SHARD_RE.match(f.name)
        if m:
            groups.setdefault((m["stem"], int(m["tp"])), {})[int(m["rank"])] = f
        else:
            loose.append(f)
    if not groups:
        ranks: dict[int, Path] = {}
        for f in loose:
            r = read_header(f).metadata.get(META_TP_RANK)
            if r is None or not r.isdigit() or int(r) in ranks:
                raise UsageError(f"{f.name}: no shard name (<stem>.rank<r>-of-<N>.safetensors) and no unique "
                                 f"{META_TP_RANK} metadata", field="INPUT", fix="rename the shards or pass a template")
            ranks[int(r)] = f
        groups[(d.name, len(ranks))] = ranks
    out = []
    for (stem, tp), ranks in sorted(groups.items()):
        if sorted(ranks) != list(range(tp)):
            raise UsageError(f"shards of {stem!r}: have ranks {sorted(ranks)}, need 0..{tp - 1}", field="INPUT",
                             fix="pass every shard of the state")
        out.append((stem, tuple(ranks[r] for r in range(tp))))
    return out


def merge_jobs(inp: str, out: str) -> list[Job]:
    sets = shard_sets(inp)
    dst = Path(out)
    for _, shards in sets:
        if len(shards) < 2:
            raise UsageError(f"only one shard found ({shards[0]})", field="INPUT", fix="a merge needs >= 2 shards")
    if len(sets) == 1 and not dst.is_dir():
        return [Job(sources=sets[0][1], targets=(dst,))]
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"INPUT holds {len(sets)} shard sets; OUTPUT must be a directory", field="OUTPUT")
    return [Job(sources=shards, targets=(dst / f"{stem}{SUFFIX}",)) for stem, shards in sets]


def check_jobs(inp: str, out: str) -> list[Job]:
    """Pairs to verify; a shard comparison is normalised to (full state) -> (its shards)."""
    a_tpl, b_tpl = _is_template(inp), _is_template(out)
    a = None if a_tpl else _existing(inp)
    b = None if b_tpl else _existing(out, "OUTPUT")
    if a is not None and a.is_file():
        if b is not None and b.is_file():
            return [Job(sources=(a,), targets=(b,))]
        if b is not None and (b / a.name).is_file() and not any(
                (m := SHARD_RE.match(f.name)) and m["stem"] == _stem(a) for f in b.iterdir()):
            return [Job(sources=(a,), targets=(b / a.name,))]
        sets = shard_sets(out)
        match = [s for stem, s in sets if stem == _stem(a)] or ([sets[0][1]] if len(sets) == 1 else [])
        if not match:
            raise UsageError(f"no shards of {a.name} in {out}", field="OUTPUT", fix="pass the shard directory")
        return [Job(sources=(a,), targets=match[0])]
    if b is not None and b.is_file():
        sets = shard_sets(inp)
        if len(sets) != 1:
            raise UsageError(f"{inp} holds {len(sets)} shard sets", field="INPUT", fix="pass one set")
        return [Job(sources=(b,), targets=sets[0][1])]
    assert a is not None and b is not None
    return [Job(sources=(f,), targets=(b / f.name,)) for f in _files(a)]
