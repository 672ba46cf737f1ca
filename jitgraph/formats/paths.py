"""Output paths, checked before long work: writable for real, and never one of the inputs.

Every file jitgraph writes goes to a temporary file beside its target, renamed over it when
complete (`temp_path`); `check_writable` creates and removes that very temporary file, so a
target the write would fail on (a read-only directory, a file in /proc, a full disk's
directory) is refused before anything compiles or trains. `check_not_inputs` refuses an output
that is one of the command's inputs (the same file by inode, so `./x`, `../dir/x`, symlinks and
hard links count)."""
from __future__ import annotations

import os
import secrets


def temp_path(path) -> str:
    """The temporary file an atomic write of `path` uses: hidden, beside it, random suffix."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")


def write_atomic(path, data: bytes) -> None:
    """Write `data` to `path` through its temporary file, renamed over `path` when complete."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def check_writable(path, what=None) -> None:
    """Raise OSError naming `path` (and `what`, e.g. "--out") unless a file can be written at
    `path`: its directory exists, `path` is not a directory nor anything but a regular file, and
    the temporary file of the atomic write can be created there (it is created and removed)."""
    path = os.fspath(path)
    label = f"{what} {path}" if what else path
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{label}: is a directory; give a file name")
    if not os.path.exists(directory):
        raise FileNotFoundError(f"{label}: directory {directory} does not exist")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{label}: {directory} is not a directory")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise FileExistsError(f"{label}: exists and is not a regular file")
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise type(e)(e.errno, f"cannot create a file in {directory} ({e.strerror})",
                      label) from None
    os.close(fd)
    os.unlink(tmp)


def same_file(a, b) -> bool:
    """Whether paths `a` and `b` name one file: the same inode when both exist (symlinks and
    hard links count), else the same resolved path."""
    a, b = os.fspath(a), os.fspath(b)
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_not_inputs(outputs: dict, inputs: dict, allow=()) -> None:
    """Raise ValueError when an output path is one of the inputs or another output.

    `outputs` and `inputs` map an option's name ("--out", "--text", "base model") to a path or
    None; an input that is a directory (--data) stands for the files in it. `allow` holds the
    (output, input) pairs that may name one file (("--checkpoint", "--resume"): a run continues
    into its own checkpoint)."""
    def files(path):
        if os.path.isdir(path):
            with os.scandir(path) as it:
                return [e.path for e in it if e.is_file()]
        return [path]

    outs = [(flag, os.fspath(p)) for flag, p in outputs.items() if p]
    for i, (flag, out) in enumerate(outs):
        for other, path in outs[i + 1:]:
            if same_file(out, path):
                raise ValueError(f"{flag} and {other} name the same file {out}; each output "
                                 f"needs its own file")
        for what, given in inputs.items():
            if not given or (flag, what) in allow:
                continue
            for path in files(os.fspath(given)):
                if same_file(out, path):
                    named = given if path == os.fspath(given) else f"{path} (in {what} {given})"
                    raise ValueError(f"{flag} {out} is the input {what} {named}; writing it "
                                     f"would destroy the input: give a new file name")
