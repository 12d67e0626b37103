"""The admin CLI on `app.cli`: `flask --app wsgi keys …`, `… blocklist …` (access control),
`… jobs …` and `… batches …` (every caller's jobs and batches, which the API shows only to their
owner).

The commands talk to the Redis named by REDIS_URL (the same one the web processes use), so they work
from any shell that can reach it, the docker-compose web container included. Every failure is a
one-line `Error: …` and exit code 1, never a traceback. It sits beside the app factory, not inside
web/api/ or web/access/, because it drives both.
"""
from __future__ import annotations

import functools
import getpass
import json
import time

import click
import redis
from flask import Flask
from flask.cli import AppGroup

from web import access
from web.access import abuse, blocklist, keys
from web.access.ownership import ANONYMOUS
from web.api import batches, jobs
from web.api.queue import job_queue, owner
from web.batch.store import STATUSES
from web.durations import format_duration, parse_duration
from worker.protocol import APIError

keys_cli = AppGroup("keys", help="Create, list and revoke API keys.")
blocklist_cli = AppGroup("blocklist", help="Block end users (the `user` field) or API keys.")
jobs_cli = AppGroup("jobs", help="See and cancel the jobs of every caller.")
batches_cli = AppGroup("batches", help="See and cancel the batches of every caller.")


def register_cli(app: Flask) -> None:
    app.cli.add_command(keys_cli)
    app.cli.add_command(blocklist_cli)
    app.cli.add_command(jobs_cli)
    app.cli.add_command(batches_cli)


def admin_command(f):
    """Turn Redis failures into a clear message and exit code 1."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except redis.RedisError as exc:
            pool = access.redis_client().connection_pool
            kw = pool.connection_kwargs
            where = kw.get("path") or (f"{kw['host']}:{kw.get('port')}" if kw.get("host") else repr(pool))
            raise click.ClickException(f"Cannot use Redis at {where} (set REDIS_URL): {exc}") from None
    return wrapper


# ---- keys ----

@keys_cli.command("create")
@click.argument("name")
@click.option("--rpm", type=click.IntRange(min=0), help="Requests per minute (0: no limit; default: server's).")
@click.option("--tpm", type=click.IntRange(min=0), help="Tokens per minute (0: no limit; default: server's).")
@admin_command
def keys_create(name: str, rpm: int | None, tpm: int | None) -> None:
    """Create an API key NAME and print it (it is shown only this once)."""
    try:
        token, record = keys.create(access.redis_client(), name, rpm=rpm, tpm=tpm)
    except keys.ApiKeyError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(token)
    click.echo(f"Created API key {name!r} ({_limits(record)}). Store it now: it cannot be shown again.", err=True)


@keys_cli.command("list")
@admin_command
def keys_list() -> None:
    """List API keys (names and limits; the keys themselves are not stored)."""
    records = keys.list_keys(access.redis_client())
    if not records:
        click.echo("No API keys.")
        return
    _table(["NAME", "KEY", "RPM", "TPM", "CREATED"],
           [[k.name, k.redacted, _limit(k.rpm), _limit(k.tpm), _when(k.created_at)] for k in records])


@keys_cli.command("revoke")
@click.argument("name")
@admin_command
def keys_revoke(name: str) -> None:
    """Revoke the API key NAME at once."""
    if not keys.revoke(access.redis_client(), name):
        raise click.ClickException(f"No API key named {name!r} (see `keys list`).")
    click.echo(f"Revoked API key {name!r}.")


# ---- blocklist ----

@blocklist_cli.command("add")
@click.argument("name")
@click.option("--reason", default="", help="Why (kept in the list and the log, never told to the client).")
@click.option("--for", "duration", metavar="DURATION", help="Lift it automatically after e.g. 30m, 24h, 7d.")
@click.option("--key", "is_key", is_flag=True, help="NAME is an API key name, not an end user.")
@click.option("--of-key", "of_key", metavar="KEY", help="NAME is an end user of the API key KEY (with keys required, "
              "every end user belongs to the key that sends it).")
@admin_command
def blocklist_add(name: str, reason: str, duration: str | None, is_key: bool, of_key: str | None) -> None:
    """Block the end user NAME (or, with --key, the API key NAME) at once, in every web process."""
    if not name.strip():
        raise click.ClickException("NAME must not be empty.")
    seconds = _parse_duration(duration) if duration is not None else None
    kind, name = _blocklist_subject(name, is_key, of_key)
    entry = blocklist.add(access.redis_client(), kind, name, reason=reason, by=_admin(), duration=seconds)
    until = f"until {_when(entry.expires_at)}" if entry.expires_at else "until removed"
    click.echo(f"Blocked {_subject(kind, name)} {until}.")


@blocklist_cli.command("remove")
@click.argument("name")
@click.option("--key", "is_key", is_flag=True, help="NAME is an API key name, not an end user.")
@click.option("--of-key", "of_key", metavar="KEY", help="NAME is an end user of the API key KEY.")
@admin_command
def blocklist_remove(name: str, is_key: bool, of_key: str | None) -> None:
    """Unblock the end user NAME (or, with --key, the API key NAME), and clear its abuse strikes."""
    kind, name = _blocklist_subject(name, is_key, of_key)
    r = access.redis_client()
    if not blocklist.remove(r, kind, name, by=_admin()):
        raise click.ClickException(f"{_subject(kind, name).capitalize()} is not on the blocklist (see `blocklist list`).")
    abuse.forgive(r, kind, name)
    click.echo(f"Unblocked {_subject(kind, name)}.")


@blocklist_cli.command("list")
@admin_command
def blocklist_list() -> None:
    """Show who is blocked: user, reason, added by/at, expiry."""
    entries = blocklist.entries(access.redis_client())
    if not entries:
        click.echo("The blocklist is empty.")
        return
    _table(["USER", "REASON", "ADDED BY", "ADDED AT", "EXPIRES"],
           [[_label(e.kind, e.name), e.reason or "-", e.added_by, _when(e.added_at), _expiry(e.expires_at)]
            for e in entries])


@blocklist_cli.command("log")
@click.option("-n", "--limit", default=50, show_default=True, type=click.IntRange(min=1), help="How many changes.")
@admin_command
def blocklist_log(limit: int) -> None:
    """Show the audit trail of blocklist changes, oldest first."""
    rows = blocklist.log(access.redis_client(), limit)
    if not rows:
        click.echo("No blocklist changes recorded.")
        return
    _table(["TIME", "ACTION", "USER", "BY", "REASON", "EXPIRES"],
           [[_when(float(row["time"])), row.get("action", ""), _label(row.get("kind", "user"), row.get("name", "")),
             row.get("by", ""), row.get("reason") or "-",
             _when(float(row["expires_at"])) if row.get("expires_at") else "-"] for row in rows])


# ---- jobs ----

@jobs_cli.command("list")
@click.option("--key", "key_name", metavar="NAME", help="Only the jobs of the API key NAME.")
@click.option("--status", type=click.Choice(jobs.STATUSES),
              help="Only the jobs in this state.")
@click.option("--model", help="Only the jobs of this model.")
@click.option("-n", "--limit", default=50, show_default=True, type=click.IntRange(min=1), help="How many, newest first.")
@admin_command
def jobs_list(key_name: str | None, status: str | None, model: str | None, limit: int) -> None:
    """List the jobs Redis still holds, whoever made them: id, status, model, owner, created."""
    names = _key_names()
    rows = []
    for rq_job in job_queue().jobs():
        state = jobs.job_state(rq_job)
        who = _owner_label(owner(rq_job), names)
        filters = ((status, state["status"]), (model, state["model"]), (key_name, who))
        if all(wanted in (None, value) for wanted, value in filters):
            rows.append([state["id"], state["status"], state["model"], who, state["created"]])
    if not rows:
        click.echo("No jobs.")
        return
    rows = sorted(rows, key=lambda row: row[-1], reverse=True)[:limit]
    _table(["ID", "STATUS", "MODEL", "OWNER", "CREATED"], [[*row[:-1], _when(row[-1])] for row in rows])


@jobs_cli.command("show")
@click.argument("job_id")
@admin_command
def jobs_show(job_id: str) -> None:
    """Print the job JOB_ID as the API shows it to its owner, with its owner, as JSON."""
    rq_job = _job(job_id)
    click.echo(json.dumps({**jobs.job_state(rq_job), "owner": _owner_label(owner(rq_job), _key_names())}, indent=2))


@jobs_cli.command("cancel")
@click.argument("job_id")
@admin_command
def jobs_cancel(job_id: str) -> None:
    """Cancel the job JOB_ID, whoever made it (a finished job stays as it ended)."""
    rq_job = _job(job_id)
    status = jobs.job_state(rq_job)["status"]
    if status not in jobs.ACTIVE:
        click.echo(f"Job {job_id} had already ended: {status}.")
        return
    jobs.cancel(rq_job)
    click.echo(f"Cancelled job {job_id} (it was {status}).")


def _job(job_id: str):
    try:
        return jobs.find_job(job_id, caller=None)
    except APIError as exc:
        raise click.ClickException(f"{exc.message} (see `jobs list`)") from None


def _key_names() -> dict[str, str]:
    return {record.id: record.name for record in keys.list_keys(access.redis_client())}


def _owner_label(who: str | None, names: dict[str, str]) -> str:
    """An owner (web/access/ownership.py) as the admin knows it: the key's name, or its lookup id
    once the key is revoked."""
    if who is None or who == ANONYMOUS:
        return who or "-"
    key_id = who.removeprefix("key:")
    return names.get(key_id, f"{keys.PREFIX}{key_id}… (revoked)")


# ---- batches ----

@batches_cli.command("list")
@click.option("--key", "key_name", metavar="NAME", help="Only the batches of the API key NAME.")
@click.option("--status", type=click.Choice(STATUSES), help="Only the batches in this state.")
@click.option("-n", "--limit", default=50, show_default=True, type=click.IntRange(min=1), help="How many, newest first.")
@admin_command
def batches_list(key_name: str | None, status: str | None, limit: int) -> None:
    """List every caller's batches: id, status, model, lines done of all (failed ones), owner, times."""
    names = _key_names()
    rows, after = [], None
    while len(rows) < limit:
        page, more = batches.batch_store().list(None, after=after, limit=100)
        for b in page:
            who = _owner_label(b.owner, names)
            if status in (None, b.status) and key_name in (None, who):
                rows.append([b.id, b.status, b.model or "-", f"{b.completed + b.failed}/{b.total}", str(b.failed),
                             who, _when(b.created_at), _when(b.expires_at)])
        if not more:
            break
        after = page[-1].id
    if not rows:
        click.echo("No batches.")
        return
    _table(["ID", "STATUS", "MODEL", "DONE", "FAILED", "OWNER", "CREATED", "EXPIRES"], rows[:limit])


@batches_cli.command("cancel")
@click.argument("batch_id")
@admin_command
def batches_cancel(batch_id: str) -> None:
    """Cancel the batch BATCH_ID, whoever made it: no more of its lines start, the running ones stop."""
    try:
        batch = batches.cancel(batches.find_batch(batch_id, caller=None))
    except APIError as exc:
        raise click.ClickException(f"{exc.message} (see `batches list`)") from None
    done = batch.completed + batch.failed
    click.echo(f"Batch {batch_id} is {batch.status} ({done} of {batch.total} lines had finished).")


# ---- helpers ----

def _parse_duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _admin() -> str:
    """Who made a change, for the audit log: the OS user running the command."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, e.g. in some containers
        return "admin"


def _blocklist_subject(name: str, is_key: bool, of_key: str | None) -> tuple[str, str]:
    """(kind, name) of a blocklist entry: an API key, or an end user, scoped to its key if given."""
    if is_key and of_key:
        raise click.ClickException("--key and --of-key exclude each other.")
    if is_key:
        return "key", name
    return "user", access.end_user(of_key, name) if of_key else name


def _subject(kind: str, name: str) -> str:
    if kind == "key":
        return f"API key {name!r}"
    key, sep, user = name.partition(":")
    return f"user {user!r} of API key {key!r}" if sep else f"user {name!r}"


def _label(kind: str, name: str) -> str:
    return name if kind == "user" else f"key:{name}"


def _limit(value: int | None) -> str:
    return "default" if value is None else ("none" if value == 0 else str(value))


def _limits(record: keys.ApiKey) -> str:
    return f"rpm {_limit(record.rpm)}, tpm {_limit(record.tpm)}"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def _expiry(expires_at: float | None) -> str:
    if expires_at is None:
        return "never"
    return f"{_when(expires_at)} (in {format_duration(expires_at - time.time())})"


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        click.echo("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
