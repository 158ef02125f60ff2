"""The one YAML reader of everything scalelm takes as settings: training configs, the site file, the workflow's config
files and `--set KEY=VALUE` values. Stricter than yaml.safe_load where it would silently lose or blow up a setting:

- a key given twice is refused (safe_load keeps the last, dropping the first without a word);
- anchors and aliases (&name, *name) are refused: a few hundred bytes of nested aliases stand for gigabytes once
  anything walks or prints the value, and settings never need them (a study's `training:` defaults, merged into
  each experiment, and the `local:` overlay are the ways to share settings);
- nesting deeper than MAX_DEPTH is refused (settings nest a few levels; a deep file exhausts Python's stack);
- a file that cannot be read (a directory, a pipe or a device, over MAX_BYTES, not UTF-8, missing) is one error
  naming it.

Settings read are then typed by `from_mapping`, one strict rule for every dataclass of settings (training, site,
study, a checkpoint's model): an unknown key is refused naming the closest known one, a value of the wrong type naming
its key. Every refusal is a ConfigError naming the file (or the override) and, where it has one, the line. JSON
(Snakemake takes it for a config file) is read too. What scalelm writes as settings (dump_settings) holds no aliases,
and error messages quote a value at most a few hundred characters long (shown)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import stat
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from scalelm.errors import ConfigError

MAX_BYTES = 2**20  # a settings file's size; YAML reads about 1 MB/s, and settings take a few KiB
MAX_DEPTH = 32  # mappings and lists within each other; the deepest settings (a study's experiment's model) take 5


class Refused(yaml.YAMLError):
    """What SettingsLoader refuses, and where."""

    def __init__(self, message: str, mark: yaml.Mark) -> None:
        super().__init__(message)
        self.message, self.line = message, mark.line + 1


class SettingsLoader(yaml.SafeLoader):
    """yaml.SafeLoader without duplicate keys, anchors, aliases or deep nesting."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise Refused(
                "YAML anchors and aliases (&name, *name) are not accepted in settings: write the value out",
                event.start_mark,
            )
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise Refused(f"nested more than {MAX_DEPTH} levels deep (settings nest a few)", event.start_mark)
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first_line.get(key)
            except TypeError:  # unhashable: the constructor's own error names it
                break
            if seen is not None:
                raise Refused(
                    f"key {shown(key)} appears twice (first on line {seen}); keep one (YAML would silently keep the "
                    "last)",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


class SettingsDumper(yaml.SafeDumper):
    """yaml.SafeDumper that writes a value held twice out twice, as SettingsLoader reads it (never &id001, *id001)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_settings(settings: dict[str, Any]) -> str:
    """Settings as the YAML text SettingsLoader reads back the same, in their order."""
    return yaml.dump(settings, Dumper=SettingsDumper, sort_keys=False)


def parse_settings(text: str) -> Any:
    """`text` as YAML under SettingsLoader's rules; a yaml.YAMLError (Refused among them) when it is not.
    JSON is YAML, but for tabs between its tokens: JSON that YAML refuses is read as JSON (Snakemake's config files
    may be JSON), its duplicate keys refused too."""
    try:
        return parse_yaml(text)
    except Refused:
        raise
    except yaml.YAMLError as err:
        try:
            return json.loads(text, object_pairs_hook=unique_keys)
        except (ValueError, RecursionError):  # not JSON either: YAML's error says why
            raise err from None


def parse_yaml(text: str) -> Any:
    loader = SettingsLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:  # a safety net: MAX_DEPTH stops nesting well before Python's stack would
        raise yaml.YAMLError(f"nested too deeply (more than {MAX_DEPTH} levels)") from None
    except ValueError as err:  # an integer beyond Python's 4300 digits, a date with month 13
        raise yaml.YAMLError(f"a value cannot be read: {str(err).split(';')[0]}") from None
    finally:
        loader.dispose()


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's mapping; a key in it twice is refused (json keeps the last)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise yaml.YAMLError(
                f"key {shown(key)} appears twice in one object; keep one (JSON would silently keep the last)"
            )
        found[key] = value
    return found


def read_text(path: Path, what: str) -> str:
    """A settings file's text: a regular file (a FIFO or a device would block or never end) of at most MAX_BYTES."""
    try:
        if path.is_dir():
            raise IsADirectoryError
        if not stat.S_ISREG(path.stat().st_mode):
            raise ConfigError(f"{what} {path} is not a regular file (a pipe or a device?); give a YAML file")
        with path.open("rb") as file:
            data = file.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ConfigError(
                f"{what} {path} is larger than {MAX_BYTES // 2**20} MiB, far beyond any settings (a study's take a "
                "few KiB): is it the right file?"
            )
        return data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory; give the YAML file in it") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
            "save it as UTF-8"
        ) from None
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be read: {err.strerror or err}") from None


def load_error(err: yaml.YAMLError, where: str) -> ConfigError:
    """One line naming `where` and, where known, the line of the problem."""
    if isinstance(err, Refused):
        return ConfigError(f"{where}, line {err.line}: {err.message}")
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark, context = err.problem_mark, f"{err.context}, " if err.context else ""
        return ConfigError(
            f"{where} is not valid YAML: line {mark.line + 1}, column {mark.column + 1}: {context}{err.problem}"
        )
    return ConfigError(f"{where} is not valid YAML: {err}")


def read_settings(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The mapping of settings in the YAML file `path` ({} for an empty file); `what` names it in errors."""
    path = Path(path)
    try:
        data = parse_settings(read_text(path, what))
    except yaml.YAMLError as err:
        raise load_error(err, f"{what} {path}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of settings, not {type(data).__name__}")
    return data


# ------------------------------------------------------------------------------ values quoted back in errors
def shown(value: Any, limit: int = 200) -> str:
    """`value`'s repr as an error message quotes it, cut after about `limit` characters: a value can be huge (a long
    list, a long string), and a message stays one readable line. The repr is built only as far as it is shown."""
    capped = _Capped(limit)
    capped.write(value)
    text = "".join(capped.parts)
    return text if len(text) <= limit else f"{text[:limit]}..."


class _Capped:
    """The repr of nested lists, tuples and mappings, written until `limit` characters are (then it stops)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.parts, self.length = limit, [], 0

    def emit(self, text: str) -> bool:
        """Append `text`; False once past the limit (the caller stops writing)."""
        self.parts.append(text[: self.limit + 1 - self.length])
        self.length += len(self.parts[-1])
        return self.length <= self.limit

    def write(self, value: Any) -> bool:
        if isinstance(value, dict):
            brackets, items = "{}", value.items()
        elif isinstance(value, (list, tuple)):
            brackets, items = ("[]" if isinstance(value, list) else "()"), value
        else:  # a scalar: a long string or bytes cut before its repr is made
            return self.emit(repr(value[: self.limit + 1] if isinstance(value, (str, bytes)) else value))
        if not self.emit(brackets[0]):
            return False
        for i, item in enumerate(items):
            if i and not self.emit(", "):
                return False
            if isinstance(value, dict):
                if not (self.write(item[0]) and self.emit(": ")):
                    return False
                item = item[1]
            if not self.write(item):
                return False
        return self.emit(brackets[1])


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check `value` against a (simple) type annotation, converting where YAML is looser than Python."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: {shown(value)} is not one of {choices}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {shown(value)}")
        return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):  # an optional section, given
        return from_mapping(annotation, value, f"{key}.")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {shown(value)}")
        if dataclasses.is_dataclass(args[1]):  # named sections of one kind (the study's experiments)
            return {k: from_mapping(args[1], v if v is not None else {}, f"{key}.{k}.") for k, v in value.items()}
        return {k: coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {shown(value)}")
        return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {shown(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {shown(value)}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {shown(value)}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {shown(value)}")
        return value
    raise TypeError(f"unsupported annotation {annotation!r} for {key}")


def from_mapping(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """An instance of the dataclass `cls` from a mapping: an unknown key is an error naming it and the closest
    known key, a value of the wrong type an error naming the key; nested dataclasses take nested mappings."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of settings, got {shown(values)}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown setting {shown(f'{prefix}{key}')}{hint}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: missing {', '.join(repr(m) for m in missing)}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):  # a section; null (every key commented out) is its defaults
            kwargs[name] = from_mapping(hint, {} if value is None else value, f"{prefix}{name}.")
        else:
            kwargs[name] = coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)
