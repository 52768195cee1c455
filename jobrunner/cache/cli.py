"""`jobrunner cache stats URL` and `jobrunner cache prune URL --older-than 30d | --max-size 10GB`."""
from __future__ import annotations

import json
import sys

import click

from jobrunner.config.option_values import JobConfigError, parse_size

# maintenance (pyarrow) is imported by the command that uses it: `jobrunner --help` loads no pyarrow


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group()
def cache():
    """Inspect and prune a result cache (see submit --cache)."""


@cache.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def stats(url, as_json):
    """Shards, entries, bytes and ages of the cache at URL.

    \b
    Exit codes: 0 printed; 2 no cache at URL (a mistyped path is not an empty cache) or it cannot be read.
    """
    from jobrunner.cache.maintenance import cache_stats
    try:
        s = cache_stats(url)
    except (ImportError, ValueError, OSError) as e:
        _fail(f"cannot read the cache at {url}: {e}")
    click.echo(json.dumps(s, indent=2) if as_json else "\n".join(f"{k:18s} {v}" for k, v in s.items()))


@cache.command()
@click.argument("url")
@click.option("--older-than", help="Delete entries written more than this long ago, e.g. 30d, 12h, 2w.")
@click.option("--max-size", help="Then delete the oldest entries until the cache is at most this size, e.g. 10GB.")
def prune(url, older_than, max_size):
    """Delete the cache's oldest shards by age and/or total size.

    \b
    Exit codes: 0 pruned (what was deleted is printed); 2 nothing asked to prune, a bad --older-than
    or --max-size, or a cache that cannot be read or pruned.
    """
    from jobrunner.cache.maintenance import parse_duration, prune as prune_cache
    if older_than is None and max_size is None:
        _fail("say what to prune: --older-than 30d and/or --max-size 10GB")
    try:
        age = parse_duration(older_than) if older_than is not None else None
        size = parse_size(max_size) if max_size is not None else None
    except (ValueError, JobConfigError) as e:
        _fail(str(e))
    try:
        s = prune_cache(url, older_than_s=age, max_size=size)
    except (ImportError, ValueError, OSError) as e:
        _fail(f"cannot prune the cache at {url}: {e}")
    click.echo("\n".join(f"{k:20s} {v}" for k, v in s.items()))
