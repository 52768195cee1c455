"""`--ray [ADDRESS]` and its options: one frozen value, the parallel section's `ray` option
(`cfg.parallel.ray`, None without Ray; TOML `ray`, API `ray=`), checking itself when built.

    --ray [ADDRESS]        auto (default): the cluster this process runs in (`ray job submit -- jobrunner
                           submit --ray auto ...`); ray://head:10001: a client; host:port: a head's GCS;
                           local: a private one-node cluster in this process, on loopback
    --ray-min-workers N    fail (exit 2) unless N workers are placed within --ray-timeout
    --ray-max-workers N    workers to start at most (default --data-parallel, else the cluster's GPUs //
                           --tensor-parallel, else 1); the cluster places them where it can, late ones join
    --ray-resources JSON   each worker's resources: CPU, GPU, memory (bytes) and any custom resource
    --ray-timeout S        seconds to wait for the first --ray-min-workers workers to be placed and loaded
    --ray-max-restarts N   Ray restarts a dead worker's actor this often (its engine loads again)

In TOML: `ray = "auto"`, or a table `[ray]` with `address`, `min_workers`, `max_workers`, `resources`,
`timeout_s`, `max_restarts`. None of these change a row's output: they are not in the fingerprint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from jobrunner.config.option_values import JobConfigError

# the command line's parameter names (cli_options' "Ray" group) -> RayOptions' fields
CLI_PARAMS = {"ray": "address", "ray_min_workers": "min_workers", "ray_max_workers": "max_workers",
              "ray_resources": "resources", "ray_timeout": "timeout_s", "ray_max_restarts": "max_restarts"}
SPECIAL_RESOURCES = ("CPU", "GPU", "memory")     # actor options, not custom resources


def _bad(message: str):
    """A Ray option that cannot run: JobConfigError (exit 2)."""
    raise JobConfigError(message)


@dataclass(frozen=True)
class RayOptions:
    address: str = "auto"
    min_workers: int = 1
    max_workers: int | None = None
    resources: tuple[tuple[str, float], ...] = ()     # sorted (name, amount) pairs: hashable, frozen
    timeout_s: float = 300.0
    max_restarts: int = 1

    @classmethod
    def from_value(cls, value) -> RayOptions:
        """From TOML or the API: an address string, a table of these fields, or a RayOptions."""
        if isinstance(value, RayOptions):
            return value
        if isinstance(value, str):
            value = {"address": value}
        if not isinstance(value, dict):
            _bad(f"ray must be an address (e.g. \"auto\") or a table of {', '.join(_names())}, "
                                  f"not {value!r}")
        unknown = sorted(set(value) - set(_names()))
        if unknown:
            _bad(f"ray: unknown keys {', '.join(unknown)} (known: {', '.join(_names())})")
        d = dict(value)
        if "resources" in d:
            d["resources"] = parse_resources(d["resources"])
        for key, want in (("min_workers", int), ("max_workers", int), ("max_restarts", int), ("timeout_s", float)):
            v = d.get(key)
            if v is None or isinstance(v, bool):
                if v is not None:
                    _bad(f"ray {key} must be a number, not {v!r}")
                continue
            if want is float and isinstance(v, int):
                d[key] = float(v)
            elif not isinstance(v, want):
                _bad(f"ray {key} must be {'an integer' if want is int else 'a number'}, not {v!r}")
        if not isinstance(d.get("address", "auto"), str) or not d.get("address", "auto").strip():
            _bad("--ray ADDRESS must be auto, local, ray://host:port or host:port")
        return cls(**d)

    @property
    def resource_dict(self) -> dict[str, float]:
        return dict(self.resources)

    def __post_init__(self):
        if self.min_workers < 1:
            _bad("--ray-min-workers must be >= 1")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            _bad(f"--ray-max-workers {self.max_workers} is below --ray-min-workers "
                                  f"{self.min_workers}")
        if not self.timeout_s > 0:
            _bad("--ray-timeout must be > 0 seconds")
        if self.max_restarts < 0:
            _bad("--ray-max-restarts must be >= 0 (-1 is not allowed: a worker that keeps "
                                  "dying would restart forever)")


def parse_resources(value) -> tuple[tuple[str, float], ...]:
    """--ray-resources: a JSON object (or a TOML table) of non-negative amounts, e.g. '{"CPU": 4, "TPU": 1}'."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            _bad(f"--ray-resources is not valid JSON ({e}); write e.g. "
                 "'{\"CPU\": 4, \"accelerator_type:A100\": 0.001}'")
    if isinstance(value, (list, tuple)):
        value = dict(value)
    if not isinstance(value, dict):
        _bad('--ray-resources must be a JSON object, e.g. \'{"CPU": 4}\'')
    for k, v in value.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            _bad(f"--ray-resources: {k!r} must be a non-negative number, not {v!r}")
    return tuple(sorted((k, float(v)) for k, v in value.items()))


def fold_cli(params: dict) -> dict:
    """The command line's --ray* parameters (given ones only) as one `ray` value (a dict for from_value);
    JobConfigError when a --ray-* option comes without --ray."""
    params = dict(params)
    given = {CLI_PARAMS[k]: params.pop(k) for k in list(params) if k in CLI_PARAMS}
    if not given:
        return params
    if "address" not in given:
        names = ", ".join("--" + k.replace("_", "-") for k, f in CLI_PARAMS.items() if f in given)
        _bad(f"{names} need --ray [ADDRESS]")
    params["ray"] = given
    return params


def _names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(RayOptions))

