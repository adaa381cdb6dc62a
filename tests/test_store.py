"""The run store against real databases: a SQLite file in tmp_path and a PostgreSQL server started for the session.

PostgreSQL runs with a non-UTC session time zone and a percent-encoded URL, so that time-zone handling and the
Alembic config's '%' escaping are exercised. Without PostgreSQL binaries its parametrisation is skipped.
"""

import math
import os
import re
import sqlite3
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from postgres import postgres_server, unavailable_reason

from hybridflow.flows.store.run_store import (
    LEASE_TTL_S,
    RUN_STATUSES,
    Base,
    Checkpoint,
    LeaseHeldError,
    LeaseLostError,
    MetricPoint,
    Placement,
    RunStore,
    RunStoreError,
    UnknownPlanError,
    UnknownRunError,
    alembic_config,
    code_version,
    controller_state,
    default_db_url,
)

TABLES = {"runs", "iterations", "metrics", "checkpoints", "placements", "samples", "stage_times", "recoveries"}
SHA_A, SHA_B = "a" * 64, "0123456789abcdef" * 4
PG_SESSION_OPTIONS = "?options=-c%20timezone%3DAsia%2FKolkata"  # UTC+05:30


@pytest.fixture(scope="session")
def postgres():
    """One PostgreSQL server for the whole session (skipped where the binaries are missing)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The URL of a new, empty database: a SQLite file, or a fresh database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store' / 'runs.db'}"  # the folder does not exist yet: the store makes it
    server = request.getfixturevalue("postgres")
    return server.url(server.create_database()) + PG_SESSION_OPTIONS


@pytest.fixture
def store(db_url):
    with RunStore(db_url) as opened:
        yield opened


def _head(url: str) -> str:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def _count(store: RunStore, table: str) -> int:
    with store.engine.connect() as conn:
        return conn.scalar(sa.text(f"SELECT count(*) FROM {table}"))


def _close_to_now(moment: datetime) -> bool:
    return moment.utcoffset() == timedelta(0) and abs(datetime.now(UTC) - moment) < timedelta(minutes=1)


# ------------------------------------------------------------------------------------------------------- schema


def test_migrations_bring_empty_db_to_head(db_url):
    if db_url.startswith("sqlite"):
        assert not Path(db_url.removeprefix("sqlite:///")).parent.exists()  # the store creates folder and file
    else:
        engine = sa.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() is None
            assert sa.inspect(conn).get_table_names() == []
        engine.dispose()

    with RunStore(db_url) as store:
        head = _head(db_url)
        assert head == "0019"
        with store.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == head
        inspector = sa.inspect(store.engine)
        assert set(inspector.get_table_names()) >= TABLES
        metric_uniques = [u["column_names"] for u in inspector.get_unique_constraints("metrics")]
        assert ["run_id", "step", "name"] in metric_uniques
        metric_indexes = {i["name"]: i["column_names"] for i in inspector.get_indexes("metrics")}
        assert metric_indexes["ix_metrics_run_id_name_step"] == ["run_id", "name", "step"]
        for table in TABLES - {"runs"}:
            assert [fk["referred_table"] for fk in inspector.get_foreign_keys(table)] == ["runs"], table


def test_migration_matches_models(store):
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"migrations and ORM models disagree: {diff}"


def test_reopen_is_idempotent(db_url):
    with RunStore(db_url) as store:
        run_id = store.create_run({"lr": 1e-6}, "exp")
    for _ in range(2):
        with RunStore.open(db_url) as store:
            assert store.current_revision() == _head(db_url)
            assert [r.id for r in store.list_runs()] == [run_id]
            assert _count(store, "alembic_version") == 1


def test_database_newer_than_code_is_refused(db_url):
    with RunStore(db_url) as store, store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(RunStoreError, match="9999.*upgrade HybridFlow"):
        RunStore(db_url)


def test_foreign_keys_are_enforced(store):
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO metrics (run_id, step, name, value) VALUES ('ghost', 0, 'x', 1.0)"))
    assert _count(store, "metrics") == 0


# --------------------------------------------------------------------------------------------------------- runs


def test_create_list_get_runs(store):
    configs = [{"trainer": {"total_iterations": i}, "tags": ["a", i]} for i in range(3)]
    ids = [store.create_run(config, f"exp-{i}") for i, config in enumerate(configs)]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"run-\d{8}-\d{6}-[0-9a-f]{6}", run_id) for run_id in ids)

    assert [r.id for r in store.list_runs()] == ids[::-1], "newest first"
    assert [r.id for r in store.list_runs(limit=2)] == ids[:0:-1]

    run = store.get_run(ids[1])
    assert (run.experiment_name, run.config, run.status) == ("exp-1", configs[1], "pending")
    assert run.code_version == code_version() and run.code_version.startswith("0.1.0")
    assert _close_to_now(run.created_at), run.created_at
    assert run.started_at is run.ended_at is run.error is run.prefect_flow_run_id is None
    assert run.to_dict()["created_at"].endswith("+00:00")
    assert run.kind == "rl"  # what hf run records
    rm_id = store.create_run({}, "rm", kind="rm")
    assert store.get_run(rm_id).kind == "rm" and store.list_runs(limit=1)[0].kind == "rm"
    for kind in ("sft", "dpo"):  # PostgreSQL's CHECK constraint allows every kind (migrations 0010, 0017)
        assert store.get_run(store.create_run({}, kind, kind=kind)).kind == kind
    with pytest.raises(ValueError, match="run kind must be one of rl, rm, sft, dpo, got 'ppo'"):
        store.create_run({}, "x", kind="ppo")


def test_create_run_rejects_config_that_is_not_json(store):
    with pytest.raises(ValueError, match="not JSON-serialisable.*model_dump"):
        store.create_run({"model": {"path": Path("/models/x")}}, "exp")
    with pytest.raises(ValueError, match="experiment_name"):
        store.create_run({}, "")
    assert store.list_runs() == []


def test_status_transitions_set_times(store):
    run_id = store.create_run({}, "exp")
    store.set_status(run_id, "running")
    first = store.get_run(run_id)
    assert first.status == "running" and _close_to_now(first.started_at) and first.ended_at is None

    store.set_status(run_id, "failed", error="Traceback: boom")
    failed = store.get_run(run_id)
    assert (failed.status, failed.error) == ("failed", "Traceback: boom")
    assert failed.started_at == first.started_at and failed.ended_at >= failed.started_at
    assert failed.duration_s is not None and failed.duration_s >= 0

    store.set_status(run_id, "running")  # resumed: same start, no end, error cleared
    resumed = store.get_run(run_id)
    assert resumed.started_at == first.started_at and resumed.ended_at is None and resumed.error is None

    for final in ("completed", "interrupted"):
        store.set_status(run_id, final)
        ended = store.get_run(run_id)
        assert ended.status == final and ended.ended_at >= resumed.started_at

    store.set_flow_run_id(run_id, "8c1f2b1e-0000-4000-8000-000000000000")
    assert store.get_run(run_id).prefect_flow_run_id == "8c1f2b1e-0000-4000-8000-000000000000"


def test_invalid_status_lists_the_allowed_ones(store):
    run_id = store.create_run({}, "exp")
    with pytest.raises(ValueError) as info:
        store.set_status(run_id, "done")
    assert "'done'" in str(info.value) and all(status in str(info.value) for status in RUN_STATUSES)
    assert store.get_run(run_id).status == "pending"


def test_unknown_run_error_names_the_id(store):
    with pytest.raises(UnknownRunError) as info:
        store.get_run("run-20000101-000000-abcdef")
    assert isinstance(info.value, KeyError)
    assert "run-20000101-000000-abcdef" in str(info.value) and "hf runs list" in str(info.value)
    for call in (
        lambda: store.set_status("run-ghost", "running"),
        lambda: store.record_metrics("run-ghost", 0, {"loss": 1.0}),
        lambda: store.add_checkpoint("run-ghost", 0, "/ckpt", 1, SHA_A),
        lambda: store.latest_checkpoint("run-ghost"),
        lambda: store.metrics("run-ghost"),
        lambda: store.set_flow_run_id("run-ghost", "x"),
    ):
        with pytest.raises(UnknownRunError, match="run-ghost"):
            call()
    assert _count(store, "metrics") == _count(store, "checkpoints") == 0


# ------------------------------------------------------------------------------------------ iterations, metrics


def test_iterations_start_end_and_replay(store):
    run_id = store.create_run({}, "exp")
    store.start_iteration(run_id, 0)
    store.end_iteration(run_id, 0)
    store.start_iteration(run_id, 1)
    store.start_iteration(run_id, 1)  # replayed after a resume
    done, running = store.iterations(run_id)
    assert (done.step, running.step) == (0, 1)
    assert done.ended_at >= done.started_at and done.duration_s >= 0 and running.ended_at is None
    with pytest.raises(ValueError, match=r"never started; call start_iteration"):
        store.end_iteration(run_id, 5)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        store.start_iteration(run_id, -1)


def test_metrics_upsert_and_filter_by_name(store):
    run_id = store.create_run({}, "exp")
    other = store.create_run({}, "other")
    store.record_metrics(run_id, 2, {"actor/pg_loss": 3.0, "critic/vf_loss": 0.3})
    store.record_metrics(run_id, 0, {"actor/pg_loss": 1.0})
    store.record_metrics(run_id, 1, {"actor/pg_loss": 2.0, "critic/vf_loss": 0.2})
    store.record_metrics(run_id, 1, {"actor/pg_loss": np.float32(20.5)})  # replayed step: overwrites
    store.record_metrics(other, 1, {"actor/pg_loss": -1.0})

    assert store.metrics(run_id, "actor/pg_loss") == [
        MetricPoint(0, "actor/pg_loss", 1.0),
        MetricPoint(1, "actor/pg_loss", 20.5),
        MetricPoint(2, "actor/pg_loss", 3.0),
    ]
    assert [(m.step, m.name) for m in store.metrics(run_id)] == [
        (0, "actor/pg_loss"),
        (1, "actor/pg_loss"),
        (1, "critic/vf_loss"),
        (2, "actor/pg_loss"),
        (2, "critic/vf_loss"),
    ]
    assert _count(store, "metrics") == 6, "the re-recorded metric must replace its row, not add one"


def test_non_finite_metrics_are_stored_as_null(store):
    run_id = store.create_run({}, "exp")
    store.record_metrics(run_id, 0, {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 1})
    assert store.metrics(run_id) == [
        MetricPoint(0, "inf", None),
        MetricPoint(0, "nan", None),
        MetricPoint(0, "ninf", None),
        MetricPoint(0, "ok", 1.0),
    ]


def test_failing_metric_batch_leaves_no_partial_rows(store):
    run_id = store.create_run({}, "exp")
    store.record_metrics(run_id, 0, {"a": 1.0})
    # "a" and "b" are written before "c" is found bad: the whole batch must roll back.
    with pytest.raises(ValueError, match="metric 'c' at step 0 is 'oops', not a number"):
        store.record_metrics(run_id, 0, {"a": 5.0, "b": 2.0, "c": "oops"})
    assert store.metrics(run_id) == [MetricPoint(0, "a", 1.0)]
    with pytest.raises(ValueError, match="metric name"):
        store.record_metrics(run_id, 1, {"a": 1.0, "": 2.0})
    assert store.metrics(run_id) == [MetricPoint(0, "a", 1.0)]


# ---------------------------------------------------------------------------------------- checkpoints, placements


def test_latest_checkpoint_is_the_highest_complete_step(store):
    run_id = store.create_run({}, "exp")
    assert store.latest_checkpoint(run_id) is None
    store.add_checkpoint(run_id, 1, Path("/ckpt/step_1"), 1_000, SHA_A)
    store.add_checkpoint(run_id, 3, "/ckpt/step_3", 3_000, SHA_A, complete=False)  # still being written
    store.add_checkpoint(run_id, 2, "/ckpt/step_2", 2_000, SHA_B.upper())
    latest = store.latest_checkpoint(run_id)
    assert (latest.step, latest.path, latest.bytes, latest.sha256, latest.complete) == (
        2,
        "/ckpt/step_2",
        2_000,
        SHA_B,
        True,
    )
    assert _close_to_now(latest.created_at)

    store.add_checkpoint(run_id, 3, "/ckpt/step_3", 3_500, SHA_B)  # finished: the same step becomes complete
    assert store.latest_checkpoint(run_id) == Checkpoint(
        run_id, 3, "/ckpt/step_3", 3_500, SHA_B, True, store.latest_checkpoint(run_id).created_at
    )
    assert [(c.step, c.complete) for c in store.checkpoints(run_id)] == [(1, True), (2, True), (3, True)]
    with pytest.raises(ValueError, match="sha256 must be 64 hex digits"):
        store.add_checkpoint(run_id, 4, "/ckpt/step_4", 1, "abc")
    with pytest.raises(ValueError, match="bytes must be an int >= 0"):
        store.add_checkpoint(run_id, 4, "/ckpt/step_4", -1, SHA_A)
    assert len(store.checkpoints(run_id)) == 3


def test_placements_round_trip(store):
    run_id = store.create_run({}, "exp")
    rows = [
        {"role": "actor", "group_name": "actor_rollout", "ranks": [0, 1, 2, 3], "executor": "slurm",
         "slurm_job_id": 123456, "hosts": ["node-01", "node-02"]},
        {"role": "critic", "group_name": "critic", "ranks": [4], "executor": "local"},
        {"role": "reward_model", "group_name": "reward_model", "ranks": [5], "executor": "local"},
    ]  # fmt: skip
    layout = {"strategy": "megatron", "train": {"pp": 1, "tp": 2, "dp": 2}, "gen_tp_groups": [[0, 1], [2, 3]]}
    rows[0]["parallel"] = layout
    store.record_placement(run_id, rows)
    placed = store.placements(run_id)
    assert [(p.role, p.group_name, p.ranks, p.executor, p.slurm_job_id, p.hosts) for p in placed] == [
        ("actor", "actor_rollout", [0, 1, 2, 3], "slurm", "123456", ["node-01", "node-02"]),
        ("critic", "critic", [4], "local", None, []),
        ("reward_model", "reward_model", [5], "local", None, []),
    ]
    assert [p.parallel for p in placed] == [layout, None, None]
    assert all(isinstance(p, Placement) and _close_to_now(p.created_at) for p in placed)

    bad = [rows[1], {**rows[1], "role": "judge"}]
    with pytest.raises(ValueError, match=r"placement row 1: invalid role 'judge'; allowed: actor, rollout"):
        store.record_placement(run_id, bad)
    with pytest.raises(ValueError, match="placement row 0: ranks must be a list of int"):
        store.record_placement(run_id, [{**rows[1], "ranks": ["0"]}])
    with pytest.raises(ValueError, match="placement row 0: parallel must be a dict"):
        store.record_placement(run_id, [{**rows[1], "parallel": [1, 2]}])
    assert len(store.placements(run_id)) == 3


def test_samples_round_trip_replace_and_cascade(store):
    run_id = store.create_run({}, "exp")
    val = [
        {"data_source": "gsm8k", "prompt": "1+1?", "response": "2", "score": 1.0, "ground_truth": "2"},
        {"data_source": "gsm8k", "prompt": "2+2?", "response": "five", "score": float("nan"), "ground_truth": 4},
    ]
    store.record_samples(run_id, 0, "val", val)
    judged = {"prompt": "p", "response": "r", "score": 0.5, "rm_score": 0.25, "judge_text": "Yes, it is."}
    store.record_samples(run_id, 1, "train", [judged])
    store.record_samples(run_id, 2, "val", val[:1])
    got = store.samples(run_id)
    assert (got[2].rm_score, got[2].judge_text) == (0.25, "Yes, it is.") and got[0].rm_score is None
    assert [(s.step, s.kind, s.idx) for s in got] == [(0, "val", 0), (0, "val", 1), (1, "train", 0), (2, "val", 0)]
    assert got[1].score is None and got[1].ground_truth == "4" and got[2].data_source == "-"
    assert got[0].to_dict()["response"] == "2"
    store.record_samples(run_id, 0, "val", val[1:])  # a redone step replaces its samples
    assert [s.response for s in store.samples(run_id, step=0)] == ["five"]
    assert [s.step for s in store.samples(run_id, kind="train")] == [1]
    with pytest.raises(ValueError, match="sample kind must be one of train, val"):
        store.record_samples(run_id, 3, "test", val)
    with pytest.raises(ValueError, match="sample 0 of step 3 has no score"):
        store.record_samples(run_id, 3, "val", [{"prompt": "p", "response": "r"}])
    assert store.samples(run_id, step=3) == []
    store.delete_run(run_id)
    assert _count(store, "samples") == 0


def test_stage_times_round_trip_replace_and_cascade(store):
    run_id = store.create_run({}, "exp")
    t = 1_790_000_000.0
    store.record_stage_times(run_id, 1, [("gen", "actor_rollout", t, t + 2.5), ("ref", "ref", t + 2.5, t + 3.0)])
    store.record_stage_times(run_id, 1, [("values", "critic", t + 2.5, t + 3.25), ("adv", None, t + 3.5, t + 3.5)])
    draws = [("gen", "actor_rollout", t + 10, t + 11.5), ("gen", "actor_rollout", t + 12, t + 13)]  # DAPO: twice
    store.record_stage_times(run_id, 2, draws)
    first = store.stage_times(run_id, step=1)  # a redone iteration replaced its timeline
    assert [(s.stage, s.pool, s.duration_s) for s in first] == [("values", "critic", 0.75), ("adv", None, 0.0)]
    assert first[0].started_at.timestamp() == pytest.approx(t + 2.5, abs=1e-6) and first[0].to_dict()["pool"]
    assert [(s.step, s.stage) for s in store.stage_times(run_id)] == [(1, "values"), (1, "adv"), (2, "gen"), (2, "gen")]
    with pytest.raises(ValueError, match=r"span 0 \('gen'\) of step 3: start .* is not a time span"):
        store.record_stage_times(run_id, 3, [("gen", "a", t + 1, t)])
    with pytest.raises(ValueError, match=r"span 0 of step 3 must be \(stage, pool, start, end\)"):
        store.record_stage_times(run_id, 3, [("gen", t, t)])
    assert store.stage_times(run_id, step=3) == []
    store.delete_run(run_id)
    assert _count(store, "stage_times") == 0


def test_recoveries_round_trip_validate_and_cascade(store):
    run_id = store.create_run({}, "exp")
    assert store.recoveries(run_id) == []
    killed = "rank 1 (pid 42) was killed by SIGKILL"
    store.record_recovery(run_id, 3, "actor_rollout_ref", [1], killed, 2, 12.5, ["node-7"])
    store.record_recovery(run_id, 5, "generate", [0], "the job ended", 4, 0.0)
    first, second = store.recoveries(run_id)
    assert (first.step, first.group_name, first.ranks, first.resumed_from, first.lost_s, first.nodes) == (
        3, "actor_rollout_ref", [1], 2, 12.5, ["node-7"]
    )  # fmt: skip
    assert second.nodes == []
    assert "SIGKILL" in first.cause and first.failed_at <= second.failed_at and second.group_name == "generate"
    with pytest.raises(ValueError, match=r"lost_s must be seconds >= 0"):
        store.record_recovery(run_id, 6, "generate", [0], "x", 4, -1.0)
    with pytest.raises(UnknownRunError):
        store.recoveries("run-nope")
    store.delete_run(run_id)
    assert _count(store, "recoveries") == 0


def test_placement_plans_round_trip_and_runs_name_theirs(store):
    """A real search's plan (inputs, kept candidates, rejected placements, choice) reads back equal, newest first;
    a run records the plan its placement came from."""
    from hybridflow.engine.shapes import PRESETS
    from hybridflow.flows.placement.cost import Workload
    from hybridflow.flows.placement.hardware import BUILTIN
    from hybridflow.flows.placement.planner import Planner
    from hybridflow.flows.placement.render import KEPT, candidate_dict, plan_record, result_from_record

    llama = PRESETS["llama-34b"]
    workload = Workload(sequences=1024, prompt_length=1024, response_length=1024, actor_steps=1, critic_steps=1)
    result = Planner(
        {"actor": llama, "critic": llama, "ref": llama}, workload, BUILTIN["a100-80gb"], 4, 8, "all"
    ).search()
    assert result.rejected  # some placements need more than the 32 devices
    first = store.record_plan("ppo.yaml", **plan_record(result, result.best, 0.25))
    second = store.record_plan("other.yaml", **plan_record(result, None, 0.5))
    assert [p.id for p in store.plans()][:2] in ([second, first], [first, second])  # same second: either order
    plan = store.get_plan(first)
    assert plan.source == "ppo.yaml" and plan.search_s == 0.25 and plan.candidate_count == len(result.candidates)
    assert plan.chosen == candidate_dict(result.best) and plan.chosen_seconds == pytest.approx(result.best.seconds)
    assert store.get_plan(second).chosen is None
    back = result_from_record(plan.inputs, plan.candidates, plan.rejected)
    assert back.candidates == result.candidates[:KEPT] and back.rejected == result.rejected
    assert back.models == result.models and back.workload == workload and back.hardware == result.hardware
    with pytest.raises(UnknownPlanError, match="hf plans list"):
        store.get_plan("plan-nope")
    run_id = store.create_run({}, "exp", plan_id=first)
    assert store.get_run(run_id).plan_id == first and store.get_run(store.create_run({}, "exp")).plan_id is None


def test_a_store_at_revision_0001_upgrades_and_keeps_its_placements(tmp_path):
    from alembic import command

    url = f"sqlite:///{tmp_path / 'runs.db'}"
    command.upgrade(alembic_config(url), "0001")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO runs (id, experiment_name, config, status, code_version, created_at) "
                "VALUES ('run-1', 'exp', '{}', 'completed', 'v', '2026-01-01 00:00:00')"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO placements (run_id, role, group_name, ranks, executor, hosts, created_at) "
                "VALUES ('run-1', 'actor', 'g', '[0]', 'local', '[]', '2026-01-01 00:00:00')"
            )
        )
    engine.dispose()
    with RunStore(url) as store:
        assert store.current_revision() == "0019"
        [old] = store.placements("run-1")
        assert (old.group_name, old.ranks, old.parallel) == ("g", [0], None)
        insert = (
            "INSERT INTO placements (run_id, role, group_name, ranks, executor, hosts, created_at) "
            "VALUES ('run-1', :role, 'g', '[0]', 'local', '[]', '2026-01-01 00:00:00')"
        )
        with store.engine.begin() as conn:  # 0005: the database's own check allows the reward model's role
            conn.execute(sa.text(insert), {"role": "reward_model"})
        with pytest.raises(sa.exc.IntegrityError, match="ck_placements_role"), store.engine.begin() as conn:
            conn.execute(sa.text(insert), {"role": "judge"})
        assert [p.role for p in store.placements("run-1")] == ["actor", "reward_model"]
        assert store.get_run("run-1").kind == "rl"  # 0006: runs recorded before kinds existed trained policies


# ---------------------------------------------------------------------------------------- SQLite, URLs, errors


def test_two_sqlite_stores_write_concurrently(tmp_path):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    stores = [RunStore(url), RunStore(url)]
    assert stores[0].engine is not stores[1].engine
    with sqlite3.connect(tmp_path / "runs.db") as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    run_ids = [s.create_run({"writer": i}, f"writer-{i}") for i, s in enumerate(stores)]
    steps, errors, start = 30, [], threading.Barrier(2)

    def write(store: RunStore, run_id: str) -> None:
        try:
            start.wait()
            for step in range(steps):
                store.start_iteration(run_id, step)
                store.record_metrics(run_id, step, {"loss": float(step), "reward": 1.0})
                store.end_iteration(run_id, step)
        except Exception as err:  # reported below: a thread's exception would not fail the test
            errors.append(err)

    threads = [threading.Thread(target=write, args=pair) for pair in zip(stores, run_ids, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for store in stores:  # each store sees both writers' rows
        assert sorted(r.id for r in store.list_runs()) == sorted(run_ids)
        for run_id in run_ids:
            assert [m.value for m in store.metrics(run_id, "loss")] == [float(s) for s in range(steps)]
            assert all(it.ended_at is not None for it in store.iterations(run_id))
        store.close()


WRITER = """
import sys
from hybridflow.flows.store.run_store import RunStore
store = RunStore(sys.argv[1])  # both processes may find the file empty and race to migrate it
run_id = store.create_run({"writer": sys.argv[2]}, "process-writer")
for step in range(20):
    store.start_iteration(run_id, step)
    store.record_metrics(run_id, step, {"loss": float(step)})
print(run_id)
"""


def test_two_processes_migrate_and_write_one_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, url, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err.decode()[-2000:] for _, err in outputs]
    run_ids = [out.decode().strip() for out, _ in outputs]
    with RunStore(url) as store:
        assert store.current_revision() == _head(url)
        for run_id in run_ids:
            assert [m.value for m in store.metrics(run_id)] == [float(step) for step in range(20)]
            assert len(store.iterations(run_id)) == 20


def test_default_db_url(monkeypatch, tmp_path):
    monkeypatch.delenv("HYBRIDFLOW_DB_URL", raising=False)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "hf-home"))
    assert default_db_url() == f"sqlite:///{tmp_path / 'hf-home' / 'runs.db'}"
    assert (tmp_path / "hf-home").is_dir(), "the parent folder must be created"
    with RunStore() as store:
        store.create_run({}, "exp")
    assert (tmp_path / "hf-home" / "runs.db").is_file()

    monkeypatch.delenv("HYBRIDFLOW_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert default_db_url() == f"sqlite:///{tmp_path / 'user' / '.cache' / 'hybridflow' / 'runs.db'}"

    monkeypatch.setenv("HYBRIDFLOW_DB_URL", "postgresql://hf:secret@db.example:5432/runs")
    assert default_db_url() == "postgresql+psycopg://hf:secret@db.example:5432/runs"
    monkeypatch.setenv("HYBRIDFLOW_DB_URL", "postgres://hf@db/runs")
    assert default_db_url() == "postgresql+psycopg://hf@db/runs"
    monkeypatch.setenv("HYBRIDFLOW_DB_URL", "sqlite:////data/runs.db")
    assert default_db_url() == "sqlite:////data/runs.db"


def test_bad_urls_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unsupported database 'mysql'.*sqlite:///.*postgresql://"):
        RunStore("mysql://u@h/db")
    with pytest.raises(ValueError, match="cannot parse the run store URL"):
        RunStore("not a url")


def test_missing_postgres_database_is_a_run_store_error(postgres):
    with pytest.raises(RunStoreError, match="cannot open the run store postgresql.*HYBRIDFLOW_DB_URL"):
        RunStore(postgres.url("no_such_database"))


def test_run_lease_one_controller_at_a_time(store):
    """A live lease refuses a second controller (naming host and pid); a renewal by the holder keeps it; a lease
    whose process is gone, or whose heartbeat is older than LEASE_TTL_S, is taken over, and the old holder's
    renewal then fails; release clears it."""
    run_id = store.create_run({}, "exp")
    assert controller_state(store.get_run(run_id)) is None
    before = store.acquire_lease(run_id, "token-a")
    assert before.lease_host is None
    held = store.get_run(run_id)
    assert controller_state(held) == "live" and held.lease_pid == os.getpid()
    with pytest.raises(
        LeaseHeldError, match=rf"another controller \(host {re.escape(held.lease_host)}, pid {os.getpid()}"
    ):
        store.acquire_lease(run_id, "token-b")
    store.renew_lease(run_id, "token-a")
    store.acquire_lease(run_id, "token-a")  # the holder again: fine

    store.release_lease(run_id, "token-a")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.acquire_lease(run_id, "token-dead", pid=dead.pid)  # a controller whose process has ended since
    assert controller_state(store.get_run(run_id)) == "crashed"  # that process is gone
    taken = store.acquire_lease(run_id, "token-b")
    assert taken.lease_pid == dead.pid
    with pytest.raises(LeaseLostError, match="taken over"):
        store.renew_lease(run_id, "token-dead")

    with store.engine.begin() as conn:  # a heartbeat older than the TTL: crashed, even though the pid lives
        old = datetime.now(UTC) - timedelta(seconds=LEASE_TTL_S + 5)
        conn.execute(
            sa.text("update runs set heartbeat_at = :t"),
            {"t": old if "postgresql" in store.url else old.replace(tzinfo=None)},
        )
    assert controller_state(store.get_run(run_id)) == "crashed"
    store.acquire_lease(run_id, "token-c")
    store.release_lease(run_id, "token-b")  # not the holder: a no-op
    assert store.get_run(run_id).lease_pid == os.getpid()
    store.release_lease(run_id, "token-c")
    record = store.get_run(run_id)
    assert (record.lease_host, record.lease_pid, record.heartbeat_at) == (None, None, None)


def test_a_checkpoint_marked_bad_is_skipped_until_recorded_again(store):
    run_id = store.create_run({}, "exp")
    store.add_checkpoint(run_id, 1, "/ckpt/global_step_1", 10, SHA_A)
    store.add_checkpoint(run_id, 2, "/ckpt/global_step_2", 10, SHA_B)
    store.mark_checkpoint_bad(run_id, 2, "corrupt: actor/model.safetensors")
    assert store.latest_checkpoint(run_id).step == 1
    assert [c.bad_reason for c in store.checkpoints(run_id)] == [None, "corrupt: actor/model.safetensors"]
    with pytest.raises(ValueError, match="no checkpoint of step 5"):
        store.mark_checkpoint_bad(run_id, 5, "x")
    store.add_checkpoint(run_id, 2, "/ckpt/global_step_2", 12, SHA_A)  # written anew: usable again
    assert store.latest_checkpoint(run_id).step == 2 and store.latest_checkpoint(run_id).bad_reason is None


def test_sqlite_store_files_are_private(tmp_path):
    """A new SQLite store is 0600 (with its -wal file), whatever the umask; an existing 0644 one is tightened."""
    old_umask = os.umask(0o022)
    try:
        with RunStore(f"sqlite:///{tmp_path / 'new' / 'runs.db'}") as store:
            store.create_run({}, "exp")
            for name in ("runs.db", "runs.db-wal"):
                assert (tmp_path / "new" / name).stat().st_mode & 0o777 == 0o600, name
        loose = tmp_path / "old.db"
        sqlite3.connect(loose).close()
        loose.chmod(0o644)
        RunStore(f"sqlite:///{loose}").close()
        assert loose.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)
