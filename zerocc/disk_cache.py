"""The compile cache on disk: a later run of the same script loads its programs instead of compiling.

``zerocc.compile(..., cache_dir=path)`` (or ``$ZEROCC_CACHE_DIR``) turns it
on. After a compile each rank writes what it made (the captured step, the
passes' decisions, the final graph, the graph after every pass) to
``path/<model class>-rank<r>of<n>/<digest>.pkl`` (``zerocc/graph_pickle.py``);
a compile in a later process with the same ``Fingerprint`` loads it instead:
no tracing, no passes.

The fingerprint is what decides a program without tracing it:

- zerocc's own source, torch's and Python's versions, torch's default dtype
  and deterministic-algorithms setting, the ``$ZEROCC_*`` settings;
- the model's modules (class, the file it is defined in, plain attributes
  such as ``in_features`` or ``p``, hooks) and its parameters and buffers (names, shapes, dtypes,
  devices, ``requires_grad``, which are tied);
- the optimizer (class, which parameters each group holds, every group
  setting traced into the program);
- the compile options and the passes they run (registered ones included);
- the world size and this rank; the batch's signature, the optimizer
  state's structure, the caller's autocast and the modules' training modes
  (``program_cache.CacheKey``);
- the content of every source file whose code was on the stack inside the
  step when an op was traced (``tracing.recording_source_files``: helpers in
  other files too), of the model's module classes and of the optimizer's
  class: editing the model's ``forward``, or a helper it calls, misses.

What it cannot see is state read by the traced code that none of these
holds (a module-level flag in a file that made no op): clear the folder
after changing such a thing. A miss says why when an entry for the same
program of the step exists (``PROGRAM_PARTS``; ``CompileCacheWarning``);
a file that cannot be read is a miss too, and is rewritten. Every rank loads or
every rank compiles (one all-reduce decides), and loaded programs still
pass the ranks' agreement check before their first collective.
"""
from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import re
import sys
import sysconfig
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn as nn

from . import graph as g
from . import graph_pickle, optimizer_step
from .errors import CompileCacheError, CompileCacheWarning, ConfigError, user_stacklevel

CACHE_DIR_VARIABLE = "ZEROCC_CACHE_DIR"
FORMAT = 2   # bumped when what an entry holds changes shape

# the parts that say which of a step's programs an entry is (one per batch shape, ...): a miss is explained
# against an entry for the same program only
PROGRAM_PARTS = ("batch", "optimizer state", "optimizer settings", "autocast", "attention kernels", "training modes",
                 "earlier buckets")
# $ZEROCC_* settings that do not change a program, or that the options hold resolved ($ZEROCC_MEMORY_POOLS=1 is
# the default's program: keyed raw, it missed the entry stored without it)
_UNRELATED_SETTINGS = (CACHE_DIR_VARIABLE, "ZEROCC_DUMP_DIR", "ZEROCC_MEMORY_POOLS")
# attributes whose value differs from process to process for the same object: Hugging Face's GenerationConfig
# keeps hash(self), a hash of strings that follows the interpreter's hash seed (every causal LM holds one)
_PER_PROCESS_ATTRIBUTES = frozenset({"_original_object_hash"})
_FILE_IN_TRACE = re.compile(r'File "([^"]+)", line \d+')
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_PYTHON_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"])   # its version is a part


def cache_dir_of(setting: str | os.PathLike | None) -> str | None:
    """The cache folder: the ``cache_dir`` setting, else ``$ZEROCC_CACHE_DIR``, else none (no cache)."""
    if setting is not None:
        if not isinstance(setting, (str, os.PathLike)):
            raise ConfigError(f"cache_dir must be a folder's path (str or os.PathLike) or None, got {setting!r}")
        folder = os.path.expanduser(os.fspath(setting))
    else:
        value = os.environ.get(CACHE_DIR_VARIABLE)
        folder = os.path.expanduser(value) if value else None
    if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
        where = "cache_dir" if setting is not None else f"${CACHE_DIR_VARIABLE}"
        raise ConfigError(f"{where}={folder!r} is a file, not a folder: the compile cache keeps a folder per rank "
                          "there; give a folder's path (it is created if missing)")
    return folder


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a compile is for, by part (each a short text or a digest); ``digest`` names its entry."""
    parts: tuple[tuple[str, str], ...]

    @functools.cached_property
    def digest(self) -> str:
        return _sha("\n".join(f"{name}={value}" for name, value in self.parts))[:24]

    def changed_since(self, earlier: dict[str, str]) -> list[str]:
        """The parts that differ from an earlier entry's, by name."""
        now = dict(self.parts)
        return [name for name in now if earlier.get(name) != now[name]] + \
               [name for name in earlier if name not in now]


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@functools.lru_cache(maxsize=1)
def _zerocc_source_digest() -> str:
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(_PACKAGE_DIR)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(root, name), "rb") as file:
                    digest.update(name.encode() + file.read())
    return digest.hexdigest()[:24]


def _stable(value: Any, depth: int = 0) -> str:
    """A text for ``value`` that is the same in every process (no addresses): what a key may hold."""
    if depth > 4:
        return "..."
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.Size)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_stable(v, depth + 1) for v in value) + ")"
    if isinstance(value, (set, frozenset)):   # sorted: a set of strings iterates in the process's string-hash order
        return "{" + ",".join(sorted(_stable(v, depth + 1) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_stable(k, depth + 1)}:{_stable(v, depth + 1)}" for k, v in value.items()
                              if k not in _PER_PROCESS_ATTRIBUTES) + "}"
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_meta:
            return f"tensor({value.item()!r},{value.dtype})"
        return f"tensor{tuple(value.shape)}{value.dtype}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and not hasattr(value, "__dict__"):
        return type(value).__qualname__ + _stable(
            {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, depth + 1)
    if isinstance(value, functools.partial):
        return f"partial({_stable(value.func, depth + 1)},{_stable(value.args, depth + 1)})"
    if callable(value) or isinstance(value, type):
        return _code_name(value)
    if isinstance(value, enum.Enum):
        return repr(value)
    if hasattr(value, "__dict__"):   # a config object, its private attributes too (Hugging Face's
        # _attn_implementation_internal picks the attention's code path)
        return type(value).__qualname__ + _stable(vars(value), depth + 1)
    return type(value).__qualname__


def _code_name(thing) -> str:
    """A function's or class's name and the file it is defined in: two projects' ``utils.act`` (or two scripts'
    ``__main__.act``) are not one function, and the entry's source check reads the storing run's files only. A
    function no file holds (a lambda typed at a prompt or in a notebook) is its code."""
    name = f"{getattr(thing, '__module__', '?')}.{getattr(thing, '__qualname__', type(thing).__qualname__)}"
    path = _source_path(thing)
    if inspect.isfunction(thing) and not os.path.isfile(path):
        name += ":" + _sha(_function_text(thing))[:16]
    return f"{name}@{path}"


def _module_attributes(module: nn.Module) -> str:
    plain = {name: value for name, value in vars(module).items()
             if not name.startswith("_") and name != "training" and not isinstance(value, (nn.Module, torch.Tensor))}
    hooks = [hook for store in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                "_backward_pre_hooks", "_state_dict_hooks") for hook in getattr(module, store, {}).values()
             if not getattr(hook, "__module__", "").startswith("zerocc.")]   # the step's own (user_views.py)
    return _stable(plain) + _stable(hooks)


def fingerprint(step, key, released_shapes: dict[str, tuple[int, ...]], previous_plan) -> Fingerprint:
    """The fingerprint of the compile ``step`` is about to make for ``key`` (``program_cache.CacheKey``)."""
    model, optimizer, options = step.model, step.optimizer, step.options
    modules = "\n".join(f"{name}:{type(m).__module__}.{type(m).__qualname__}:{_module_attributes(m)}"
                        for name, m in model.named_modules())
    names = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    tensors = "\n".join(
        f"{'/'.join(names[id(t)])}:{tuple(released_shapes.get(n, t.shape))}:{t.dtype}:{t.device}:{t.requires_grad}:"
        f"{isinstance(t, nn.Parameter)}:{_stable(list((getattr(t, '_backward_hooks', None) or {}).values()))}"
        for n, t in [*model.named_parameters(), *model.named_buffers()])   # register_hook: traced into the step
    if step._parameter_layouts:   # channels-last parameters: read in their strides (capture.laid_out)
        tensors += "\nlaid out " + _stable(sorted(step._parameter_layouts.items()))
    index = {id(p): n for n, p in model.named_parameters()}
    # which parameters each group holds; its settings traced into the program are key.hyperparameters (float
    # settings are read every step and stay out, so a schedule does not miss)
    groups = "\n".join(",".join(index.get(id(p), "?") for p in group["params"]) for group in optimizer.param_groups)
    # state in the user's optimizer before the first call (a checkpoint loaded): the program reads it as it is
    # sorted by name: the same state inserted in another order (a checkpoint loaded) is the same program
    held = dict(sorted(
        (index.get(id(p), "?"), {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                                 for k, v in sorted(values.items())})
        for p, values in optimizer.state.items())) if not step.state.started else {}
    skipped = ("timeout", "dump_dir", "static_shapes", "max_programs", "cache_dir", "device_budget", "hardware",
               "progress")
    option_text = _stable({f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in skipped})
    passes = _stable([(p.name, p.run) for p in options.passes()])
    settings = _stable(sorted((k, v) for k, v in os.environ.items()
                              if k.startswith("ZEROCC_") and k not in _UNRELATED_SETTINGS))
    parts = (
        ("format", str(FORMAT)),
        ("zerocc source", _zerocc_source_digest()),
        ("torch", f"{torch.__version__} python {sys.version_info[:3]} default dtype {torch.get_default_dtype()} "
                  f"deterministic {torch.are_deterministic_algorithms_enabled()}"),
        ("$ZEROCC settings", settings),
        ("model modules", _sha(modules)[:24]),
        ("model tensors", _sha(tensors)[:24]),
        ("optimizer", f"{type(optimizer).__module__}.{type(optimizer).__qualname__} " + _sha(groups)[:16]),
        ("code", _code_identity(step)),
        ("options", _sha(option_text)[:24]),
        ("passes", _sha(passes)[:24]),
        ("ranks", f"rank {step.ranks.rank} of {step.ranks.world_size}"),
        ("batch", _sha(_stable(key.signature))[:24]),
        ("optimizer state", _sha(_stable(key.state) + _stable(step.state.state_signature) + _stable(held))[:24]),
        ("optimizer settings", _sha(_stable(key.hyperparameters))[:24]),
        ("autocast", _stable(key.autocast)),
        ("attention kernels", _stable(key.attention)),
        ("training modes", _sha(_stable(key.training))[:24]),
        ("python values", _sha(_stable(key.python))[:24]),   # numbers forward and the loss read (a loss weight)
        ("saved-tensor hooks", _stable(key.saved_tensors_hooks)),
        ("earlier buckets", _sha(_stable(previous_plan))[:24]),
    )
    return Fingerprint(parts)


def _code_identity(step) -> str:
    """Where the code of the model's module classes, the optimizer's class and the loss function lives, and, when
    the script is no file (``python -c``, standard input, a notebook), that code itself.

    Classes are named by module and name, and the entry's source check reads the files of the run that stored it:
    two scripts sharing a folder, each with its own ``__main__.Net`` (one ``F.gelu``, one ``F.relu``), had one
    fingerprint, and the second loaded the first's program, its files unchanged. Code no file holds was in no
    source check at all: an edited ``forward`` in a notebook loaded the program traced before the edit.
    """
    things = {type(m) for m in step.model.modules()} | {type(step.optimizer)}
    things |= {fn for fn in (step.options.loss_fn, step.options.metrics_fn) if fn is not None}
    text = "\n".join(sorted(_code_name(thing) for thing in things))
    main = sys.modules.get("__main__")
    if main is not None and not os.path.isfile(getattr(main, "__file__", None) or ""):
        text += "\n" + _interactive_code(main)
    return _sha(text)[:24]


def _source_path(thing) -> str:
    try:
        return os.path.abspath(inspect.getsourcefile(thing) or "?")
    except (TypeError, OSError):
        return "?"


def _interactive_code(main) -> str:
    """The code of the functions and classes defined in ``__main__`` (bytecode, names, constants, defaults) and the
    plain values of its globals that code reads (``SCALE`` in ``x * SCALE``; not a notebook's ``lr`` or history
    variables), in a text the same in every process of one Python version."""
    lines, read = [], set()
    for name, value in sorted(vars(main).items()):
        if getattr(value, "__module__", None) == "__main__" and (inspect.isfunction(value) or inspect.isclass(value)):
            functions = [value] if inspect.isfunction(value) else [
                getattr(member, "fget", None) or getattr(member, "__func__", member) for _, member in
                sorted(vars(value).items()) if isinstance(member, (staticmethod, classmethod, property))
                or inspect.isfunction(member)]
            functions = [f for f in functions if inspect.isfunction(f)]
            lines.append(f"{name}:" + ",".join(_function_text(f) for f in functions))
            read.update(name for f in functions for name in _names_read(f.__code__))
    lines += [f"{name}={value!r}" for name, value in sorted(vars(main).items()) if name in read
              and (value is None or isinstance(value, (bool, int, float, str)))]
    return _sha("\n".join(lines))


def _names_read(code) -> set[str]:
    return set(code.co_names).union(*(_names_read(c) for c in code.co_consts if inspect.iscode(c)))


def _function_text(function) -> str:
    return _code_text(function.__code__) + _stable(function.__defaults__) + _stable(function.__kwdefaults__)


def _code_text(code) -> str:
    def constant(value) -> str:
        if inspect.iscode(value):
            return _code_text(value)
        if isinstance(value, (tuple, frozenset)):   # a frozenset's order follows the process's string hashes
            texts = [constant(v) for v in value]
            return "(" + ",".join(sorted(texts) if isinstance(value, frozenset) else texts) + ")"
        return repr(value)
    return f"{code.co_code.hex()}{code.co_names}{','.join(constant(c) for c in code.co_consts)}"


def source_files(captured, step) -> dict[str, str]:
    """Every file whose code the traced step ran, by path, with its content's digest (zerocc's, torch's and
    Python's own files are covered by their version parts): the files on the stack while an op was traced
    (``tracing.recording_source_files``: helpers outside any ``forward`` too), those named in the nodes' stack
    traces, the model's module classes', the optimizer's, the loss function's and the passes'."""
    paths = set(captured.gm.meta.get(g.SOURCE_FILES, ()))
    for node in captured.gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            paths.update(_FILE_IN_TRACE.findall(trace))
    things: list[Any] = [type(m) for m in step.model.modules()] + [type(step.optimizer)]
    things += [fn for fn in (step.options.loss_fn, step.options.metrics_fn) if fn is not None]
    things += [p.run for p in step.options.passes()]
    for thing in things:
        try:
            paths.add(inspect.getsourcefile(thing))
        except (TypeError, OSError):
            pass
    found = {}
    for path in sorted(p for p in paths if p):
        path = os.path.abspath(path)
        if path.startswith((_PACKAGE_DIR + os.sep, _TORCH_DIR + os.sep)) or _in_python_itself(path):
            continue
        digest = _file_digest(path)
        if digest is not None:
            found[path] = digest
    return found


def _in_python_itself(path: str) -> bool:
    """Python's standard library (its version is a part), not the packages installed beside it."""
    if not path.startswith(_PYTHON_DIR + os.sep):
        return False
    return not {"site-packages", "dist-packages"} & set(path[len(_PYTHON_DIR):].split(os.sep))


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as file:
            return _sha(file.read())[:24]
    except OSError:
        return None


def settings_modes_key(optimizer: torch.optim.Optimizer) -> str:
    """What decides ``optimizer_step.live_modes`` for ``optimizer`` now, as a digest: zerocc's source (how the
    modes are found), torch's and Python's versions, the optimizer's classes and their files' content (its
    ``step()``), and per param group what the probe reads (``settings_structure``: each setting's class or sign,
    the parameters' dtype; the first parameter's shape and the parameters' devices). Another optimizer class, an
    edited ``step()``, another group structure or a setting crossing zero is another key."""
    classes = [cls for cls in type(optimizer).__mro__ if cls is not object]
    groups = [(tuple(group["params"][0].shape) if group["params"] else None,
               sorted({p.device.type for p in group["params"]})) for group in optimizer.param_groups]
    text = "\n".join([
        str(FORMAT), _zerocc_source_digest(), f"{torch.__version__} python {sys.version_info[:3]}",
        *(f"{_code_name(cls)}:{_file_digest(_source_path(cls))}" for cls in classes),
        # nested deeper than a fingerprint's values (groups, settings, a tuple setting's classes): no "..." cut
        _stable(optimizer_step.settings_structure(optimizer), depth=-8), _stable(groups)])
    return _sha(text)[:24]


def _modes_from_json(value, groups: int) -> optimizer_step.Modes | None:
    """The modes a ``.modes`` file holds (per group, [key, position, mode] rows), or None if it holds no such
    thing (another format, edited by hand, for another number of groups)."""
    if not isinstance(value, dict) or not isinstance(value.get("modes"), list) or len(value["modes"]) != groups:
        return None
    modes = []
    for rows in value["modes"]:
        if not isinstance(rows, list) or not all(
                isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                and (row[1] is None or type(row[1]) is int) and row[2] in (optimizer_step.FREE, optimizer_step.SIGNED)
                for row in rows):
            return None
        modes.append({(key, position): mode for key, position, mode in rows})
    return modes


class DiskCache:
    """One rank's entries for one model class in the cache folder."""

    def __init__(self, directory: str, model: nn.Module, rank: int, world_size: int):
        self.folder = os.path.join(directory, f"{type(model).__name__}-rank{rank}of{world_size}")
        self.last_outcome = "not used yet"   # report()["compile_cache"]

    def _path(self, digest: str, suffix: str) -> str:
        return os.path.join(self.folder, digest + suffix)

    def find(self, fingerprint: Fingerprint) -> tuple[dict | None, str]:
        """The index of the entry for ``fingerprint`` if one is stored and its source files are unchanged, and
        why not."""
        index = self._read_json(self._path(fingerprint.digest, ".json"))
        if index is None:
            return None, self._why_missing(fingerprint)
        if index.get("parts") != dict(fingerprint.parts):   # renamed or copied from another entry (another rank's)
            changed = fingerprint.changed_since(index.get("parts", {}))
            return None, "the entry under this name was stored for another step: " + ", ".join(changed)
        changed = [path for path, digest in index.get("sources", {}).items() if _file_digest(path) != digest]
        if changed:
            return None, "source changed: " + ", ".join(_short(p) for p in changed[:3]) + \
                (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        return index, "found"

    def _why_missing(self, fingerprint: Fingerprint) -> str:
        """What changed since an entry for the same program of the step (the same batch signature, optimizer
        state, ...: ``PROGRAM_PARTS``) was stored; "no entry" when there is none, as for a new batch shape."""
        now = dict(fingerprint.parts)
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return "no entry"
        changes = []   # per entry for the same program: what changed since it
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            parts = (self._read_json(os.path.join(self.folder, name)) or {}).get("parts", {})
            if all(parts.get(part) == now.get(part) for part in PROGRAM_PARTS):
                changes.append(fingerprint.changed_since(parts))
        if not changes:
            return "no entry"
        # the nearest entry: against any other (the same model under other options) more would seem to have changed
        return "changed since the entry for this program: " + ", ".join(min(changes, key=len))

    @staticmethod
    def _read_json(path: str) -> dict | None:
        try:
            with open(path) as file:
                index = json.load(file)
        except (OSError, ValueError):
            return None
        # another format's index (a newer zerocc's, edited by hand) is no entry
        return index if isinstance(index, dict) and all(
            isinstance(index.get(part, {}), dict) for part in ("parts", "sources", "digests")) else None

    def load(self, digest: str, index: dict, objects: dict[str, Any], fake_mode, history_now: bool = False
             ) -> dict | None:
        """The stored compile, or None (with a warning) if the file cannot be read or is not the one ``index``
        names (its content's digest: a file truncated, changed, or of another write). Its ``history`` (the graph
        after every pass) is read when first used, as most runs never print one, or now (``history_now``: a
        ``dump_dir`` writes it)."""
        path = self._path(digest, ".pkl")
        try:
            payload = graph_pickle.loads(_read_verified(path, index, "program"), objects, fake_mode)
            payload["history"] = StoredHistory(self._path(digest, ".history.pkl"), index, objects, fake_mode)
            if history_now:
                path = payload["history"].path
                payload["history"] = list(graph_pickle.loads(_read_verified(path, index, "history"), objects,
                                                             fake_mode))
        except Exception as error:   # a truncated or foreign file: compile, and write it again
            warnings.warn(f"zerocc compile cache: could not read {path} ({type(error).__name__}: {error}); "
                          "compiling instead, and replacing it", CompileCacheWarning, stacklevel=user_stacklevel())
            return None
        return payload

    def store(self, fingerprint: Fingerprint, sources: dict[str, str], payload: dict, names: dict) -> str:
        """Write the entry (atomically: a reader never sees half of one); returns what happened, for the report."""
        payload = dict(payload)
        history = payload.pop("history")
        try:
            data = graph_pickle.dumps(payload, names)
            history_data = graph_pickle.dumps(list(history), names)
        except graph_pickle.NotPicklable as error:
            return f"not stored: {error}"
        # the files' digests: a load reads only the files this index was written with (not one half written on a
        # file system without atomic renames, changed since, or replaced by another process's write in between)
        index = {"parts": dict(fingerprint.parts), "sources": sources, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "digests": {"program": _sha(data), "history": _sha(history_data)}}
        files = [self._path(fingerprint.digest, suffix) for suffix in (".pkl", ".history.pkl")]
        try:
            os.makedirs(self.folder, exist_ok=True)
            _write_atomically(files[0], data)
            _write_atomically(files[1], history_data)
            self._write_index(fingerprint.digest, index)   # last: it marks the entry complete
        except OSError as error:
            if not os.path.exists(self._path(fingerprint.digest, ".json")):   # no entry: no files of one left
                for path in files:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            warnings.warn(f"zerocc compile cache: could not write to {self.folder} ({error}); the step runs "
                          "without storing its program", CompileCacheWarning, stacklevel=user_stacklevel())
            return f"not stored: {error}"
        return f"stored ({(len(data) + len(history_data)) / 2**20:.1f} MiB)"

    def restore_settings_modes(self, optimizer: torch.optim.Optimizer) -> bool:
        """Make ``optimizer_step.live_modes`` know the optimizer's modes from the folder's ``.modes`` file for
        ``settings_modes_key``, if one is there and readable; returns whether it was.

        The modes' probe traces a fake ``step()`` (two for AdamW): a fifth of a warm-cache first step's CPU time
        on the 98M GPT, and the program's fingerprint needs its outcome (``CacheKey.hyperparameters``) before an
        entry can be looked up, so they are kept beside the entries, keyed on what the probe reads. A file that
        cannot be read, or holds something else, is no error: the probe runs.
        """
        try:
            with open(self._path(settings_modes_key(optimizer), ".modes")) as file:
                stored = _modes_from_json(json.load(file), len(optimizer.param_groups))
        except (OSError, ValueError):
            stored = None
        if stored is not None:
            optimizer_step.remember_modes(optimizer, stored)
        return stored is not None

    def store_settings_modes(self, optimizer: torch.optim.Optimizer) -> None:
        """Write the optimizer's present modes (``restore_settings_modes``) beside an entry just stored."""
        rows = [[[key, position, mode] for (key, position), mode in of_group.items()]
                for of_group in optimizer_step.live_modes(optimizer)]
        try:
            _write_atomically(self._path(settings_modes_key(optimizer), ".modes"), json.dumps({"modes": rows}).encode())
        except OSError:
            pass   # the next process probes again

    def _write_index(self, digest: str, index: dict) -> None:
        _write_atomically(self._path(digest, ".json"), json.dumps(index, indent=1).encode())

    def remember_peak(self, digest: str, peak_bytes: int) -> None:
        """The peak of live bytes the entry's program measured in its first run: a process that loads it
        reports that peak instead of measuring again (the measurement slows a step by a third)."""
        index = self._read_json(self._path(digest, ".json"))
        if index is None or index.get("measured_peak_bytes") == peak_bytes:
            return
        index["measured_peak_bytes"] = peak_bytes
        try:
            self._write_index(digest, index)
        except OSError:
            pass   # the next load measures it again


class StoredHistory(collections.abc.Sequence):
    """An entry's graph after every pass, read from its file at the first use."""

    def __init__(self, path: str, index: dict, objects: dict[str, Any], fake_mode):
        self.path, self._index, self._objects, self._fake_mode = path, index, objects, fake_mode
        self._snapshots: list | None = None

    def _read(self) -> list:
        if self._snapshots is None:
            try:
                self._snapshots = graph_pickle.loads(_read_verified(self.path, self._index, "history"), self._objects,
                                                     self._fake_mode)
            except Exception as error:
                raise CompileCacheError(
                    f"the graphs after each pass of this loaded program could not be read from {self.path} "
                    f"({type(error).__name__}: {error}); the program itself runs. Remove the file's folder to "
                    "compile (and store) again") from error
            self._objects = self._fake_mode = None
        return self._snapshots

    def __getitem__(self, index):
        return self._read()[index]

    def __len__(self) -> int:
        return len(self._read())


def _read_verified(path: str, index: dict, name: str) -> bytes:
    """The content of an entry's file, if it is what ``index`` was written with (``digests[name]``)."""
    with open(path, "rb") as file:
        data = file.read()
    if _sha(data) != index.get("digests", {}).get(name):
        raise ValueError(f"its content is not what the entry's index was written with ({len(data):,} bytes: "
                         "truncated, changed or written by another process since)")
    return data


def _write_atomically(path: str, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.chmod(temporary, 0o644)   # mkstemp's 0600 would hide the cache from the other users of a shared folder
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _short(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if not relative.startswith("..") else path


def user_objects(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The caller's objects a stored compile names instead of copying, by the names it uses: the optimizer, the
    modules, and the ``torch.Generator`` objects the modules hold (``torch.randn(..., generator=self.gen)`` draws
    from the object traced in: a loaded program must advance the loading process's, not a copy pickled with it)."""
    objects = {"optimizer": optimizer}
    for name, module in model.named_modules():
        objects[f"module:{name}"] = module
        objects.update({f"generator:{name}.{attribute}": value for attribute, value in vars(module).items()
                        if isinstance(value, torch.Generator)})
    return objects


def held_tensors(tensors_read: tuple) -> dict:
    """The tensors ``program_cache.values_read`` found outside the model (its ``[1]``: (label, name, identity or
    identities)), by id, as ``graph_pickle.HeldTensor``: a compile that reads one is not stored."""
    held = {}
    for label, name, identities in tensors_read:
        for identity in identities if isinstance(identities, tuple) else (identities,):
            if isinstance(identity, int):   # tensors' ids (a generator's C pointer never matches one)
                held[identity] = graph_pickle.HeldTensor(f"{label} {name}")
    return held


def names_of(objects: dict[str, Any]) -> dict:
    """``user_objects`` by ``graph_pickle.identity``, as ``graph_pickle.dumps`` reads them (named_modules lists each
    module once)."""
    return {graph_pickle.identity(thing): name for name, thing in objects.items()}

