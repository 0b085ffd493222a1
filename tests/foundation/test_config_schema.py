"""aipc_kernels.core.config_schema: exact types, ranges, choices and the three ways of naming a key."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import pytest

from aipc_kernels.core.config_schema import Naming, OptionError, choices_of, field_names, option, parse, to_dict


@dataclass(frozen=True)
class Example:
    size: int = option(64, choices=(32, 64, -1))
    steps: Optional[int] = option(None, ge=1, example=4)
    ratio: float = option(1.0, gt=0, le=1)
    flag: bool = option(False)
    names: list[str] = option([], example=["lm_head"])
    buckets: Optional[list[int]] = option(None, ge=1)
    path: Optional[Union[str, os.PathLike]] = option(None)

    def check(self, naming: Naming) -> None:
        if self.steps and self.size != -1 and self.steps % self.size:
            raise naming.error("steps", self.steps, f"must be a multiple of {naming.ref('size')}={self.size}")


JSON, PY, CLI = Naming("demo config", "json"), Naming("demo", "python"), Naming("demo-cli", "cli")


def test_exact_values_pass_and_defaults_fill_in():
    o = parse(Example, {"steps": 128, "ratio": 1, "flag": True, "names": ("a", "b"), "path": Path("x")}, PY)
    assert (o.size, o.steps, o.ratio, o.flag, o.names, o.buckets, o.path) == (64, 128, 1.0, True, ["a", "b"], None, Path("x"))
    assert type(o.ratio) is float and to_dict(o)["names"] == ["a", "b"]
    assert parse(Example, {}, PY).names is not parse(Example, {}, PY).names  # list defaults are not shared
    assert field_names(Example)[:2] == ("size", "steps") and choices_of(Example, "size") == (32, 64, -1)


@pytest.mark.parametrize("values, message", [
    ({"names": "lm_head"}, 'demo config.names=\'lm_head\' must be a list of strings, e.g. ["lm_head"]'),
    ({"flag": "false"}, "demo config.flag='false' must be true or false (a JSON boolean, without quotes)"),
    ({"flag": 0}, "demo config.flag=0 must be true or false"),
    ({"size": 64.5}, "demo config.size=64.5 is not supported; use one of 32, 64, -1"),
    ({"size": True}, "demo config.size=True is not supported"),
    ({"steps": True}, "demo config.steps=True must be an integer >= 1 or null, e.g. 4"),
    ({"steps": "abc"}, "demo config.steps='abc' must be an integer >= 1 or null"),
    ({"steps": 0}, "demo config.steps=0 must be an integer >= 1 or null"),
    ({"steps": 96}, "demo config.steps=96 must be a multiple of size=64"),
    ({"ratio": float("nan")}, "demo config.ratio=nan must be a number in (0, 1]"),
    ({"ratio": "0.5"}, "demo config.ratio='0.5' must be a number in (0, 1]"),
    ({"buckets": [32, 0]}, "demo config.buckets=[32, 0] must be a list of integers >= 1 or null"),
    ({"buckets": [32, False]}, "must be a list of integers >= 1 or null"),
    ({"path": 3}, "demo config.path=3 must be a string or a path (os.PathLike) or null"),
    ({"sise": 64}, "demo config has unknown keys ['sise'] (did you mean 'size'?)"),
])  # fmt: skip
def test_json_errors_name_the_key_and_the_fix(values, message):
    with pytest.raises(OptionError) as e:
        parse(Example, values, JSON)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_python_and_cli_naming():
    with pytest.raises(ValueError, match=r"^demo: flag='no' must be True or False$"):
        parse(Example, {"flag": "no"}, PY)
    with pytest.raises(ValueError, match=r"^demo: steps=96 must be a multiple of size=64$"):
        parse(Example, {"steps": 96}, PY)
    with pytest.raises(ValueError, match=r"^--steps=-1 must be an integer >= 1$"):
        parse(Example, {"steps": -1}, CLI)
    with pytest.raises(ValueError, match=r"^--steps=96 must be a multiple of --size=64$"):
        parse(Example, {"steps": 96}, CLI)
    with pytest.raises(ValueError, match=r"unknown keys \['--sise'\] \(did you mean '--size'\?\)"):
        parse(Example, {"sise": 1}, CLI)
    with pytest.raises(ValueError, match="demo config must be a JSON object of keys, got list"):
        parse(Example, [1], JSON)
