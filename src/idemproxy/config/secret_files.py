"""Secret settings given as files (`admin.token_file`, `store_file`, …), as Kubernetes mounts a
Secret's keys: the file's content is the setting's value, less one trailing line break.

Its content is never logged nor echoed in an error: only the setting's name and the path are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from idemproxy.errors import ConfigError

SUFFIX = "_file"


def read_secret_files(data: Any, names: tuple[str, ...], where: str) -> Any:
    """`data` (a model's input, before validation) with each `NAME_file` read into `NAME`.

    `where` is the dotted prefix of the model's settings ("admin.", "" for the top level), for
    the errors. Giving both `NAME` and `NAME_file` is refused: which one was meant cannot be told.
    """
    if not isinstance(data, dict):
        return data
    values = dict(data)
    for name in names:
        path = values.get(name + SUFFIX)
        if path is None or path == "":
            continue
        if values.get(name) is not None:
            raise ConfigError(
                f"{where}{name} and {where}{name}{SUFFIX} are both given: give only one"
            )
        values[name] = read_secret(Path(path), f"{where}{name}{SUFFIX}")
    return values


def read_secret(path: Path, setting: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{setting}: {path} is not UTF-8 text") from exc
    # `echo secret > file` and `kubectl create secret --from-file` leave a line break at the end.
    value = text.removesuffix("\n").removesuffix("\r")
    if not value:
        raise ConfigError(f"{setting}: {path} is empty")
    return value
