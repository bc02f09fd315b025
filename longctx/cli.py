"""The `longctx` command: ingest documents, ask questions, manage the cache store.

Answers go to stdout; progress and information to stderr. Library errors (`LongctxError`) become
one red line on stderr and exit code 1; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from typing import List, Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

import longctx
from longctx.errors import LongctxError
from longctx.kvcache.presets import DEFAULT_PRESET
from longctx.cli_render import ago, evicted_json, niah_segments_report, unit_name
from longctx.cli_render import entries_table as _entries_table
from longctx.units import human_bytes

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Ask questions of long documents from a compressed, persisted KV cache.",
)
err = Console(stderr=True)
out = Console()
_state = {"debug": False}

ModelOpt = typer.Option(
    None,
    "--model",
    "-m",
    envvar="LONGCTX_MODEL",
    help="mlx-lm model directory, .gguf file or Hugging Face id (default: SmolLM2-135M-Instruct).",
)


RopeScaleOpt = typer.Option(
    None,
    "--rope-scale",
    help="Scale RoPE by this factor to run past the model's trained context (a model of its own: ask needs no option).",
)
ParallelOpt = typer.Option(
    "tensor",
    "--parallel",
    help="Under mlx.launch: how the ranks split the work: tensor (each rank a share of every layer's heads), pipeline (each rank a run of whole layers) or, for ingest, data (each rank whole, ingesting its own segments of a long document). docs/distributed.md.",
)
RopeTypeOpt = typer.Option(
    "ntk-by-parts",
    "--rope-type",
    help="RoPE scaling with --rope-scale: ntk-by-parts (YaRN's frequencies), yarn (plus its attention temperature) or linear.",
)


def _rope_model(model: Optional[str], scale: Optional[float], kind: str) -> Optional[str]:
    # deferred: each command imports what it uses (the others start without it)
    from longctx.runtime import models

    return model if scale is None else models.with_rope_scale(model, scale, kind)


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Library warnings (a kernel falling back to its reference, ...) as one yellow line."""
    err.print(f"[yellow]warning:[/yellow] {escape(_one_line(message))}", highlight=False, soft_wrap=True)


@contextmanager
def _boundary():
    """The one place errors are turned into messages and exit codes: library errors as their
    message, anything else as an internal error, each one red line and exit code 1 (`--debug`:
    the traceback)."""
    import warnings

    shown = warnings.showwarning
    if not _state["debug"]:
        warnings.showwarning = _show_warning
    try:
        yield
    except (typer.Exit, typer.Abort, click.exceptions.ClickException):
        raise
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red]")
        raise typer.Exit(130)
    except LongctxError as e:
        if _state["debug"]:
            raise
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    except Exception as e:  # noqa: BLE001 - a bug: never a bare traceback without --debug
        if _state["debug"]:
            raise
        err.print(
            f"[red]internal error:[/red] {escape(type(e).__name__)}: "
            f"{escape(_one_line(e))}; rerun with --debug for the traceback",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)
    finally:
        warnings.showwarning = shown


def _version(value: bool):
    if value:
        out.print(f"longctx {longctx.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
):
    """Ask questions of long documents from a compressed, persisted KV cache."""
    _state["debug"] = debug
    if not debug:  # pypdf logs recoverable damage ("EOF marker not found") to stderr
        logging.getLogger("pypdf").setLevel(logging.ERROR)
        # transformers warns about sequence length on tokenization alone; we check context ourselves
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if longctx.BLAS_STATUS == "missing":
        err.print(
            "[yellow]warning:[/yellow] OpenBLAS not found; CPU prefill will be slow "
            "(Debian/Ubuntu: apt-get install libopenblas0-pthread)."
        )


@contextmanager
def _bar(description: str, unit: str):
    """A rich progress bar on stderr that appears only once work is reported (not on a cache hit)."""
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    bar = Progress(*columns, console=err, transient=False)
    task = None

    def update(done: int, total: int):
        nonlocal task
        if _state.get("follower"):
            return
        if task is None:
            bar.start()
            task = bar.add_task(description, total=total, rate="")
        speed = bar.tasks[task].speed
        bar.update(task, completed=done, total=total, rate=f"{speed:,.0f} {unit}/s" if speed else "")

    try:
        yield update
    finally:
        if task is not None:
            bar.stop()


def _warn_empty_pages(name: str, empty: tuple[int, ...], pages: int) -> None:
    if empty:
        listed = ", ".join(map(str, empty[:20])) + (", ..." if len(empty) > 20 else "")
        err.print(
            f"[yellow]warning:[/yellow] {escape(name)}: {len(empty)} of {pages} pages have no "
            f"extractable text (page{'s' if len(empty) > 1 else ''} {listed}); they are left "
            "out (scanned pages need OCR, e.g. `ocrmypdf in.pdf out.pdf`).",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def ingest(
    files: list[str] = typer.Argument(..., help="PDF, text or markdown files, or directories of them."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Ingest the files as one collection of this name."),
    model: Optional[str] = ModelOpt,
    kv: str = typer.Option(
        DEFAULT_PRESET, "--kv", help="KV cache preset: fp16, affine8, affine4, tq4, tq4k3v, tq3, tq3+qjl, rvq2+2, tq5k4v."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show pages, tokens, segments, cache size and memory; write nothing."),
    force: bool = typer.Option(False, "--force", help="Rebuild the cache even if it exists."),
    password: Optional[str] = typer.Option(None, "--password", help="Password of an encrypted PDF."),
    rope_scale: Optional[float] = RopeScaleOpt,
    rope_type: str = RopeTypeOpt,
    parallel: str = ParallelOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
):
    """Read documents, prefill them once through the model and persist their KV cache.

    A document longer than the model's context is split into segments (one cache each); `ask`
    then answers from the segments that match the question."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import multidoc
    from longctx.runtime import distributed, models

    with _boundary():
        distributed.use(parallel)
        model = _rope_model(model, rope_scale, rope_type)
        with _bar("preparing the model (once)", "tensors") as update:  # a first-time GGUF import
            models.resolve(model, progress=update)
        if dry_run:
            info = multidoc.dry_run(files, name, model, kv, password)
            for fname, empty in info.pop("_empty_pages", {}).items():
                _warn_empty_pages(fname, tuple(empty[1]), empty[0])
            if as_json:
                out.print_json(json.dumps(info))
            else:
                for k, v in info.items():
                    shown = (
                        human_bytes(v)
                        if k.endswith("bytes")
                        else (f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else v)
                    )
                    err.print(f"{k:>22}: {escape(str(shown))}", highlight=False)
            return
        with _bar("prefill", "tok") as update:
            result = multidoc.ingest_files(files, name, model, kv, force=force, password=password, progress=update)
        e = result.target
        for fname, (pages, empty) in (result.empty_pages or {}).items():
            _warn_empty_pages(fname, tuple(empty), pages)
        n_seg = len(getattr(e, "segments", ()) or ())
        what = f" in {n_seg} segments" if n_seg > 1 else ""
        if result.reused:
            err.print(
                f"[green]cached[/green] {escape(e.name)}: {e.tokens:,} tokens{what} already ingested as {e.id} (use --force to rebuild)"
            )
        else:
            s = result.stats
            err.print(
                f"[green]ingested[/green] {escape(e.name)} as {e.id}: {e.tokens:,} tokens{what} in {s.seconds:.1f} s "
                f"({s.tokens_per_second:,.0f} tok/s), peak memory {human_bytes(s.peak_bytes)}, "
                f"cache {human_bytes(e.bytes)} ({e.bytes_per_token:,.0f} B/token)"
            )
        _warn_budget(result)
        if as_json:
            out.print_json(json.dumps({**e.to_json(), "reused": result.reused, "evicted": evicted_json(result.eviction)}))


def _warn_budget(result) -> None:
    """One yellow line if the store could not be brought within its budget."""
    ev, e = result.eviction, result.entry
    if result.eviction_error:
        err.print(
            f"[yellow]warning:[/yellow] {escape(e.name)} is saved, but the store could not "
            f"be trimmed to its budget: {escape(result.eviction_error)}",
            highlight=False,
            soft_wrap=True,
        )
    elif ev is not None and ev.over_budget:
        why = (
            f"the cache of {escape(e.name)} alone ({human_bytes(e.bytes)}) exceeds it; kept it"
            if e.bytes > ev.budget
            else f"{len(ev.busy)} entries in use were kept"
        )
        err.print(
            f"[yellow]warning:[/yellow] the store holds {human_bytes(ev.bytes_after)}, over "
            f"its budget of {human_bytes(ev.budget)} (LONGCTX_MAX_STORE): {why}",
            highlight=False,
            soft_wrap=True,
        )
    if ev is not None and ev.removed:
        names = ", ".join(escape(unit_name(u)) for u in ev.removed[:5])
        err.print(
            f"evicted {len(ev.removed)} least recently used ({names}{', ...' if len(ev.removed) > 5 else ''}), "
            f"freed {human_bytes(ev.freed)}",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def ask(
    question: str = typer.Argument(..., help="The question."),
    doc: Optional[str] = typer.Option(None, "--doc", "-d", help="Document name or id (default: the latest ingested)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Must match the model of the cache (default: that model)."),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Most answer tokens."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0 = greedy)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampler seed."),
    ranker: Optional[str] = typer.Option(
        None,
        "--ranker",
        help="Segmented documents: choose segments by bm25, model (question likelihood) or attention (attention mass) (default: LONGCTX_RANKER).",
    ),
    segments: int = typer.Option(
        1, "--segments", min=1, help="Segmented documents: answer from this many best segments, keep the surest answer."
    ),
    cont: bool = typer.Option(
        False, "--continue", "-c", help="Continue the last conversation (of --doc if given): a follow-up question."
    ),
    cid: Optional[str] = typer.Option(None, "--cid", help="Continue the conversation with this id."),
    parallel: str = ParallelOpt,
    as_json: bool = typer.Option(False, "--json", help="Print answer and timings as JSON."),
):
    """Answer a question from a stored document's cache, streaming to stdout.

    Each answer is kept as a conversation: `ask -c "..."` asks a follow-up that sees the earlier
    questions and answers, in this or a later process."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import session
    from longctx import asking
    from longctx.errors import ConfigError
    from longctx.runtime import distributed

    with _boundary():
        if parallel == "data":
            raise ConfigError(
                "--parallel data spreads an ingest's segments over the ranks; ask the "
                "document in one process, or with --parallel tensor or pipeline."
            )
        distributed.use(parallel)
        answer = session.Answer()
        for piece in asking.ask(
            question,
            doc,
            model,
            max_tokens,
            temp,
            seed,
            answer=answer,
            ranker=ranker,
            segments=segments,
            conversation=cid or ("last" if cont else None),
        ):
            if not as_json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        name = answer.group.name if answer.group is not None else answer.entry.name
        if as_json:
            out.print_json(
                json.dumps(
                    {
                        "answer": answer.text,
                        "document": name,
                        "id": (answer.group or answer.entry).id,
                        "sources": answer.sources,
                        "segment": answer.entry.segment,
                        "ranking": answer.ranking,
                        "model_seconds": answer.model_seconds,
                        "restore_seconds": answer.restore_seconds,
                        "first_token_seconds": answer.first_token_seconds,
                        "conversation": getattr(answer.conversation, "cid", None),
                    }
                )
            )
        else:
            sys.stdout.write("\n")
            source = f" (from {', '.join(answer.sources)})" if answer.sources else ""
            err.print(
                f"[dim]{escape(name)}{escape(source)}: restored in {answer.restore_seconds:.2f} s, "
                f"first token after {answer.first_token_seconds:.2f} s[/dim]"
            )


@app.command()
def chat(
    doc: Optional[str] = typer.Option(None, "--doc", "-d", help="Document name or id (default: the latest ingested)."),
    resume: bool = typer.Option(False, "--resume", help="Resume the last conversation (of --doc if given)."),
    cid: Optional[str] = typer.Option(None, "--cid", help="Resume the conversation with this id."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Must match the model of the cache (default: that model)."),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1, help="Most tokens per answer."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0 = greedy)."),
):
    """Talk with a document in the terminal: follow-up questions see the earlier turns.

    Commands: /reset (a new conversation), /sources (where answers come from), /quit.
    Ctrl-C stops an answer; Ctrl-D or /quit leaves. The conversation is kept: `chat --resume`."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import asking
    from longctx.conversation import Conversation

    with _boundary():
        conv = asking.open_conversation(doc, model, cid or ("last" if resume else None))
        err.print(
            f"[dim]{escape(conv.entry.name)}: {conv.entry.tokens:,} tokens, room for "
            f"{conv.room_left:,} more; conversation {conv.cid}"
            f"{f' ({len(conv.turns)} turns)' if conv.turns else ''}. /quit to leave.[/dim]"
        )
        while True:
            try:
                err.print("[bold]you>[/bold] ", end="")
                line = input().strip()
            except (EOFError, KeyboardInterrupt):
                err.print()
                break
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            if line == "/reset":
                conv = Conversation(conv.lm, conv.entry, conv.prefix)
                err.print(f"[dim]new conversation {conv.cid}[/dim]")
                continue
            if line == "/sources":
                pages = f", {conv.entry.pages} pages" if conv.entry.pages else ""
                err.print(
                    f"[dim]answers come from {escape(conv.entry.name)}{pages} "
                    f"({conv.entry.tokens:,} tokens, entry {conv.entry.id})[/dim]"
                )
                continue
            dropped = conv.dropped
            stream = conv.ask(line, max_tokens, temp)
            try:
                for piece in stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                stream.close()
                sys.stdout.write(" [stopped]")
            sys.stdout.write("\n")
            if conv.dropped > dropped:
                err.print(
                    f"[yellow]note:[/yellow] dropped the {conv.dropped - dropped} oldest turn(s) to make room in the context"
                )
            conv.save()


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (beyond loopback needs --api-key)."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port."),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="The model to serve (default: the default model); its documents are served."
    ),
    cache_bytes: str = typer.Option("4GB", "--cache-bytes", help="Most memory of restored documents kept warm (e.g. 4GB)."),
    keep_alive: str = typer.Option(
        "5m", "--keep-alive", help="Unload a warm document after this long unused (e.g. 30s, 5m, 1h)."
    ),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1."),
    allowed_origins: Optional[List[str]] = typer.Option(
        None, "--allowed-origins", help="Browser origins allowed (CORS); repeat for several."
    ),
):
    """Serve the stored documents over an OpenAI-compatible HTTP API: each document is a model
    (GET /v1/models) to chat with (POST /v1/chat/completions, streaming or not)."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import config, server
    from longctx.errors import ConfigError

    with _boundary():
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            raise ConfigError(f"Serving on {host} (beyond this machine) needs --api-key.")
        limit = config.parse_size(cache_bytes)
        seconds = _duration(keep_alive)
        err.print(f"loading the model and serving on http://{host}:{port}/v1 (Ctrl-C stops)")
        server.serve(
            model,
            host,
            port,
            limit,
            seconds,
            api_key,
            allowed_origins,
            ready=lambda url: err.print(f"[green]ready[/green] {url}/v1"),
        )


def _duration(text: str) -> float:
    # deferred: each command imports what it uses (the others start without it)
    from longctx.errors import ConfigError

    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    try:
        if text[-1:] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise ConfigError(f"Cannot read the duration '{text}'; write e.g. 30s, 5m or 1h.") from None


@app.command()
def merge(doc: str = typer.Argument(..., help="Document name or id.")):
    """Join a document's tensor- or pipeline-parallel shards (ingested under mlx.launch) into an ordinary entry
    that one process can answer from."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import manage

    with _boundary():
        e = manage.merge(doc)
        err.print(f"[green]merged[/green] {escape(e.name)} into {e.id} ({human_bytes(e.bytes)})")


@app.command()
def reshard(
    doc: str = typer.Argument(..., help="Document name or id."),
    ranks: int = typer.Option(..., "--ranks", min=2, help="Ranks to split the cache for."),
    parallel: str = typer.Option(
        "tensor", "--parallel", help="tensor (each rank its KV heads) or pipeline (each rank a run of layers)."
    ),
):
    """Split a document's cache into shards for `ranks` processes (mlx.launch -n RANKS, with the same --parallel)."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import manage

    with _boundary():
        if parallel not in ("tensor", "pipeline"):
            # deferred: each command imports what it uses (the others start without it)
            from longctx.errors import ConfigError

            raise ConfigError(f"Unknown parallelism '{parallel}' for reshard; choose tensor or pipeline.")
        made = manage.reshard(doc, ranks, parallel)
        err.print(f"[green]resharded[/green] {escape(made[0].name)} for {ranks} ranks: " + ", ".join(e.id for e in made))


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """List ingested documents, newest first."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import manage

    with _boundary():
        usage = manage.store_usage()
        if as_json:
            out.print_json(json.dumps([{**e.to_json(), "last_used": usage.last_used[e.id]} for e in usage.entries]))
            return
        out.print(_entries_table(usage.entries, out.width, usage.last_used))
        n = len(usage.entries)
        limit = f"of a {human_bytes(usage.budget)} budget" if usage.budget is not None else "with no budget"
        out.print(f"{n} entr{'y' if n == 1 else 'ies'}, {human_bytes(usage.bytes)} {limit} (LONGCTX_MAX_STORE)", highlight=False)


@app.command()
def info(
    doc: Optional[str] = typer.Argument(None, help="Document name or id (default: latest)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Show one ingested document's cache."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import manage

    with _boundary():
        e = manage.find_entry(doc)
        data = {**e.to_json(), "bytes_per_token": round(e.bytes_per_token, 1)}
        room = manage.room(e)
        if room is not None:
            data["room_tokens"] = room  # what is left of the context for questions and conversations
        if as_json:
            out.print_json(json.dumps(data))
            return
        listed = data.pop("segments", None)
        files = data.pop("files", None)
        for k, v in data.items():
            out.print(f"{k:>18}: {human_bytes(v) if k == 'bytes' else escape(str(v))}", highlight=False)
        for f in files or ():
            out.print(f"{'file':>18}: {escape(f['name'])} ({f['kind']}, {f['pages']} pages)", highlight=False)
        for i, sg in enumerate(listed or ()):
            out.print(
                f"{'segment ' + str(i + 1):>18}: {sg['id']}  {sg['tokens']:>7,} tok  {escape(sg['label'])}", highlight=False
            )


@app.command()
def export(
    doc: Optional[str] = typer.Argument(None, help="Document name or id (default: latest)."),
    out: str = typer.Option(..., "--out", "-o", help="Destination .safetensors file."),
    fmt: str = typer.Option("mlx-lm", "--format", help="Only 'mlx-lm' for now."),
    kv: str = typer.Option("fp16", "--kv", help="Stock cache type: fp16, affine8 or affine4."),
):
    """Write a stock mlx-lm prompt cache (`mlx_lm.generate --prompt-cache-file FILE`)."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import manage
    from longctx.errors import ConfigError

    with _boundary():
        if fmt != "mlx-lm":
            raise ConfigError(f"Unknown export format '{fmt}'; only 'mlx-lm' is supported.")
        path = manage.export(doc, out, kv)
        err.print(
            f"wrote {escape(str(path))} ({human_bytes(path.stat().st_size)}); answer from it with "
            f"`mlx_lm.generate --prompt-cache-file {escape(str(path))} --prompt \"...\"`",
            highlight=False,
        )


@app.command()
def rm(doc: str = typer.Argument(..., help="Document name or id.")):
    """Remove an ingested document's cache and index entry."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import manage

    with _boundary():
        e = manage.remove_entry(doc)
        err.print(f"removed {escape(e.name)} ({e.id}, {human_bytes(e.bytes)})")


@app.command()
def gc(
    max_size: Optional[str] = typer.Option(
        None,
        "--max-size",
        help="Evict down to this size (20GB, 500MiB, bytes; 0: all not in use) instead of the budget (LONGCTX_MAX_STORE).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be removed; remove nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
):
    """Evict least recently used documents down to the store's budget; clean crash leftovers."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx import manage

    with _boundary():
        cleaned, ev = manage.gc(max_size, dry_run)
        if as_json:
            out.print_json(
                json.dumps(
                    {
                        "dry_run": dry_run,
                        "budget": ev.budget,
                        "bytes_before": ev.bytes_before,
                        "bytes_after": ev.bytes_after,
                        "freed": ev.freed,
                        "evicted": evicted_json(ev),
                        "busy": [u.key for u in ev.busy],
                        "cleaned": cleaned,
                    }
                )
            )
            return
        verb = "would remove" if dry_run else "removed"
        for u in ev.removed:
            err.print(
                f"{verb} {escape(unit_name(u))} ({u.key}, {human_bytes(u.bytes)}, last used {ago(u.last_used)})", highlight=False
            )
        leftovers = sum(cleaned.values())
        limit = human_bytes(ev.budget) if ev.budget is not None else "no limit"
        err.print(
            f"{'would free' if dry_run else 'freed'} {human_bytes(ev.freed)}: the store "
            f"{'would hold' if dry_run else 'holds'} {human_bytes(ev.bytes_after)} of {limit}"
            + (f"; {len(ev.busy)} entries in use kept" if ev.busy else "")
            + (f"; cleaned {leftovers} crash leftovers" if leftovers else ""),
            highlight=False,
        )


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks through the product path.")
app.add_typer(bench_app, name="bench")


def _split(values: list[str]) -> list[str]:
    return [v for item in values for v in item.replace(",", " ").split()]


@bench_app.command("niah")
def bench_niah(
    lengths: list[str] = typer.Option(
        ["1k,2k,4k,8k,16k,32k"],
        "--lengths",
        help="Context lengths (e.g. 1k,2k or 2048); those above the model's context run as segmented documents, asked through each --rankers.",
    ),
    depths: Optional[list[str]] = typer.Option(
        None, "--depths", help="Needle depths in percent (default 0,10,...,100; past the context 0,25,50,75,100)."
    ),
    rankers: list[str] = typer.Option(
        ["bm25,model,attention"], "--rankers", help="Segment rankers compared past the context (bm25, model, attention)."
    ),
    kv: list[str] = typer.Option(
        ["fp16,tq4"],
        "--kv",
        help="KV presets (fp16 is always included as the baseline; past the context, the first other preset only).",
    ),
    task: list[str] = typer.Option(["single"], "--task", help="single, uuid, multikey or multivalue (repeatable)."),
    samples: int = typer.Option(1, "--samples", min=1, help="Haystacks per cell."),
    model: Optional[str] = ModelOpt,
    out_dir: str = typer.Option("niah-results", "--out", help="Folder for the JSON, PNGs and haystack documents."),
    seed: int = typer.Option(0, "--seed", help="Seed of needles and prose order."),
    shared: bool = typer.Option(
        False, "--shared", help="One haystack per length holding every depth's needle (faster; adds distractors)."
    ),
    rope_scale: Optional[float] = RopeScaleOpt,
    rope_type: str = RopeTypeOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the results JSON on stdout."),
):
    """Needle-in-a-haystack (RULER tasks): ingest haystacks, ask from the restored caches, score.

    Lengths past the model's context are split into segment caches; their needle is asked for
    literally and in paraphrase with each ranker (recall@1/@2 of the needle's segment, accuracy)."""
    from pathlib import Path

    # deferred: each command imports what it uses (the others start without it)
    from longctx.bench import niah, niah_segments, plot
    from longctx.bench.env import safe_name
    from longctx.errors import ConfigError

    with _boundary():
        try:
            depth_list = [float(d) / 100 for d in _split(depths)] if depths else None
        except ValueError:
            raise ConfigError("Depths are percentages, e.g. --depths 0,50,100.") from None
        length_list = [niah.parse_length(n) for n in _split(lengths)]
        model = _rope_model(model, rope_scale, rope_type)
        folder = Path(out_dir)
        context = niah_segments.context_length(model)
        fit = [n for n in length_list if n <= context]
        past = [n for n in length_list if n > context]
        for t in _split(task) if fit or not past else []:
            with _bar(f"niah {t}", "ingests") as update:
                res = niah.run(
                    model,
                    t,
                    fit,
                    depth_list or niah.DEFAULT_DEPTHS,
                    _split(kv),
                    samples,
                    seed,
                    workdir=folder / "docs",
                    shared=shared,
                    progress=update,
                )
            _niah_table(res)
            _save_niah(res, folder, f"niah_{safe_name(res.model_id)}_{t}", plot.heatmaps, as_json)
        if past:
            presets = [p for p in _split(kv) if p != niah.BASELINE] or [niah.BASELINE]
            with _bar("niah past the context", "documents") as update:
                seg = niah_segments.run(
                    model,
                    past,
                    depth_list or niah_segments.DEFAULT_DEPTHS,
                    _split(rankers),
                    preset=presets[0],
                    seed=seed,
                    workdir=folder / "docs",
                    progress=update,
                )
            _niah_segments_table(seg)
            _save_niah(seg, folder, f"niah_segments_{safe_name(seg.model_id)}", plot.segment_heatmaps, as_json)


def _save_niah(res, folder, stem: str, draw, as_json: bool) -> None:
    """Write a NIAH run's JSON and its heatmaps (`draw`, a `bench.plot` function; skipped with a
    warning without matplotlib) under `folder`; `--json` prints the results too."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx.bench import niah

    path = niah.save(res, folder / f"{stem}.json")
    try:
        pngs = draw(res, folder, stem)
        err.print(f"wrote {path} and {len(pngs)} heatmap(s) in {folder}", highlight=False)
    except ImportError:
        err.print(
            f"wrote {path}; [yellow]warning:[/yellow] matplotlib is not installed, no heatmaps (pip install 'longctx[bench]')",
            highlight=False,
        )
    if as_json:
        out.print_json(json.dumps(res.to_json()))


def _niah_segments_table(res) -> None:
    table, lines = niah_segments_report(res)
    err.print(table)
    for line in lines:
        err.print(line, highlight=False)


def _niah_table(res) -> None:
    label = lambda n: f"{n / 1024:g}k" if n % 256 == 0 else str(n)  # noqa: E731
    table = Table(
        "kv",
        *[label(n) for n in res.lengths],
        "score",
        "bits/ch",
        "B/token",
        "answer s",
        title=f"NIAH {res.task}: {res.model_id} (mean over depths and samples)",
    )
    summary = res.summary()
    for p in res.presets:
        if p not in summary:
            continue
        by_len = []
        for n in res.lengths:
            s = [c.score for c in res.cells if c.preset == p and c.length == n]
            by_len.append(f"{sum(s) / len(s):.2f}" if s else "-")
        s = summary[p]
        table.add_row(
            p,
            *by_len,
            f"{s['score']:.3f}",
            f"{s['bits_per_channel']:.2f}",
            f"{s['cache_bytes_per_token']:,.0f}",
            f"{s['mean_answer_seconds']:.2f}",
        )
    err.print(table)
    for p, s in summary.items():
        err.print(
            f"{p}: score {s['score']:.3f}, {s['bits_per_channel']:.2f} bits/channel, cache "
            f"{human_bytes(s['cache_bytes_longest'])} at {s['tokens_longest']:,} tokens, "
            f"answer {s['mean_answer_seconds']:.2f} s, ingest {s['mean_ingest_seconds']:.2f} s",
            highlight=False,
        )


def _quiet_followers() -> None:
    """Under mlx.launch only rank 0 prints answers and progress (every rank still prints its
    own errors)."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx.runtime import distributed

    if distributed.launched() and os.environ.get("MLX_RANK", "0") != "0":
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        _state["follower"] = True


def main() -> None:
    """The `longctx` process entry: answering starts without importing transformers."""
    # deferred: each command imports what it uses (the others start without it)
    from longctx.runtime.blas import tune_malloc
    from longctx.runtime.light import defer_mlx_lm_init

    tune_malloc()
    defer_mlx_lm_init()
    _quiet_followers()
    try:
        app(prog_name="longctx")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not longctx.BLAS_STATUS.startswith("loaded:"):
            raise
        # The preloaded OpenBLAS (Debian's 0.3.21 pthread build) can deadlock in its exit-time
        # thread shutdown (`blas_thread_shutdown_` joins a worker parked on a condition variable:
        # seen in 4 of 6 `ask` runs of a segmented document on a 2-core VM). Everything the
        # command wrote is fsynced and the store is closed by now, so run Python's exit
        # handlers, flush, and skip only the C libraries' finalizers.
        import atexit

        getattr(atexit, "_run_exitfuncs", lambda: None)()
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
