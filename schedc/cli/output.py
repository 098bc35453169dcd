"""Files a command writes at its end (`schedc train --log/--save-weights`): checked before
the work starts, written whole or not at all.

`schedc.plan.check_output_file` asks the file system's permissions; as root,
or on /proc, /sys and read-only mounts, those say "writable" for a folder no
file can be created in. `check_writable` therefore also creates (and
removes) a file there. `write_atomic` writes a temporary file beside the
target and renames it into place, so a reader never sees half a file, and
the temporary file is removed when writing fails.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from schedc.diagnostics import RunError, error

HINT = "choose a file in a writable directory"


def check_writable(path: str | os.PathLike, what: str) -> None:
    """E558 unless a file can be created beside `path` (and `path` is not a folder or read-only)."""
    from schedc.plan import check_output_file

    check_output_file(path, what)
    probe = _temporary(Path(path), "probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        folder = Path(path).parent if str(Path(path).parent) else Path(".")
        raise RunError([error("E558", f"{what} `{path}` cannot be written: no file can be created in "
                                      f"`{folder}` ({exc.strerror or exc})", hint=HINT)]) from None
    os.close(fd)
    os.unlink(probe)


def write_atomic(path: str | os.PathLike, what: str, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary file beside `path`, renamed onto `path` once written; E558
    (and no file left) when it cannot be."""
    target = Path(path)
    if target.is_symlink():  # written through the link, to its target (the link stays the user's)
        target = target.resolve()
    tmp = _temporary(target, "tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError as exc:
        raise RunError([error("E558", f"cannot write {what} `{target}`: {exc.strerror or exc}", hint=HINT)]) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _temporary(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.{kind}")
