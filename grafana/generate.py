#!/usr/bin/env python3
"""Writes relay's Grafana dashboards (grafana/dashboards/*.json).

The dashboards are generated, not edited by hand: change a panel here and run
`python3 grafana/generate.py`. Every panel queries the Prometheus datasource
provisioned with uid `relay-prometheus`, filters on the `run_id` template
variable and uses `$__rate_interval` for every range (Grafana makes it at
least 4 x the datasource's 2 s `timeInterval`, so `rate()` always sees
several scrapes). `services/relay/tests/dashboards.rs` runs every query
against a real stack.

Metric names come from the services' registries (services/*/src/lib.rs) and
the tracker, which re-exports what services report (configs/metrics.yaml
lists them all). Labels worth knowing:

- every series: `run_id`, `service`, `env_id` (const labels), plus `job`,
  `instance` and `replica` (the service copy, e.g. `env-runner-0`) that
  Prometheus adds from file-based discovery;
- values re-exported by the tracker carry `source` (the reporting service)
  and `copy` (the reporting copy, e.g. `env-runner-0`).
"""

import json
import pathlib

DS = {"type": "prometheus", "uid": "relay-prometheus"}
RUN = 'run_id=~"$run_id"'
RI = "$__rate_interval"
INF = 'service="inference-server"'
RB = 'service="replay-buffer"'
OUT = pathlib.Path(__file__).resolve().parent / "dashboards"


def sel(metric, extra=""):
    """`metric{run_id=~"$run_id",extra}`."""
    return f"{metric}{{{RUN}{',' + extra if extra else ''}}}"


def quantiles(histogram, by="run_id", qs=(0.5, 0.9, 0.99), extra="", prefix="{{run_id}} "):
    """Targets for quantiles of a Prometheus histogram, per `by`."""
    return [
        t(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({sel(histogram + '_bucket', extra)}[{RI}])))",
            f"{prefix}p{round(q * 100)}",
        )
        for q in qs
    ]


def t(expr, legend="", **extra):
    """One Prometheus target (refIds are filled in by the panel)."""
    target = {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend, "range": True}
    target.update(extra)
    return target


def thresholds(*steps):
    """Absolute thresholds: thresholds('green', 0.5, 'red') means green below 0.5, red above."""
    out = [{"color": steps[0], "value": None}]
    for value, color in zip(steps[1::2], steps[2::2]):
        out.append({"color": color, "value": value})
    return {"mode": "absolute", "steps": out}


def panel(kind, title, targets, w=12, h=8, unit="short", description="", decimals=None, minimum=None,
          maximum=None, steps=None, threshold_style=None, right_axis=(), options=None, custom=None,
          mappings=None, transformations=None):
    targets = [dict(target, refId=chr(ord("A") + i)) for i, target in enumerate(targets)]
    defaults = {"unit": unit}
    if decimals is not None:
        defaults["decimals"] = decimals
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    defaults["thresholds"] = steps or thresholds("green")
    if mappings:
        defaults["mappings"] = mappings
    if kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": True,
            "axisSoftMin": 0 if minimum is None and unit in ("short", "s", "ops") else None,
            "thresholdsStyle": {"mode": threshold_style or "off"},
        }
        if defaults["custom"]["axisSoftMin"] is None:
            del defaults["custom"]["axisSoftMin"]
    if custom:
        defaults.setdefault("custom", {}).update(custom)
    overrides = [
        {
            "matcher": {"id": "byFrameRefID", "options": ref},
            "properties": [{"id": "custom.axisPlacement", "value": "right"}],
        }
        for ref in right_axis
    ]
    p = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"w": w, "h": h},
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "options": options if options is not None else default_options(kind),
        "targets": targets,
    }
    if transformations:
        p["transformations"] = transformations
    return p


def default_options(kind):
    if kind == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    if kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    if kind == "gauge":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showThresholdLabels": False,
            "showThresholdMarkers": True,
        }
    if kind == "heatmap":
        return {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "yAxis": {"axisPlacement": "left", "unit": "short"},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"show": True, "yHistogram": False},
            "legend": {"show": True},
        }
    if kind == "table":
        return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}}
    if kind == "state-timeline":
        return {
            "mergeValues": True,
            "showValue": "never",
            "alignValue": "left",
            "rowHeight": 0.9,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "single", "sort": "none"},
        }
    return {}


def stat(title, expr, legend="{{run_id}}", **kw):
    kw.setdefault("w", 4)
    kw.setdefault("h", 4)
    return panel("stat", title, [t(expr, legend, instant=True, range=False)], **kw)


def row(title):
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"w": 24, "h": 1}, "panels": []}


def layout(panels):
    """Flows panels left to right into a 24-column grid; numbers them 1, 2, ..."""
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24 or p["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        p["id"] = i
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return panels


def dashboard(uid, title, description, panels, refresh="5s"):
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["relay"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": refresh,
        "time": {"from": "now-15m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [
            {
                "title": "relay dashboards",
                "type": "dashboards",
                "tags": ["relay"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {
            "list": [
                {
                    "name": "run_id",
                    "label": "run",
                    "description": "Run ids (newest first for the default `<env>-<algo>-<yyyymmdd-hhmmss>` ids).",
                    "type": "query",
                    "datasource": DS,
                    "definition": "label_values(relay_episodes_total, run_id)",
                    "query": {
                        "qryType": 1,
                        "query": "label_values(relay_episodes_total, run_id)",
                        "refId": "PrometheusVariableQueryEditor-VariableQuery",
                    },
                    "refresh": 2,
                    "regex": "",
                    "sort": 2,
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "current": {},
                    "options": [],
                    "hide": 0,
                }
            ]
        },
        "panels": layout(panels),
    }


# --- training overview --------------------------------------------------------

training = dashboard(
    "relay-training",
    "relay: training overview",
    "Is the run learning? Returns, throughput, progress and updates.",
    [
        panel(
            "gauge", "Progress (env-step budget)",
            [t(sel("relay_learner_progress"), "{{run_id}}", instant=True, range=False)],
            w=4, h=5, unit="percentunit", minimum=0, maximum=1,
            steps=thresholds("blue", 1, "green"),
            description="Env steps trained on / run.total_env_steps (learner_progress).",
        ),
        stat("Env steps trained", sel("relay_learner_env_steps"), h=5,
             description="Env steps the learner has consumed."),
        stat("Updates", sel("relay_learner_updates"), h=5, description="PPO updates made."),
        stat("Latest eval return", sel("relay_eval_return_mean"), "{{run_id}} {{evaluator}}", h=5, decimals=1,
             description="Mean return of the latest evaluation (deterministic episodes on eval seeds)."),
        stat("Episodes", sel("relay_episodes_total"), h=5, description="Training episodes finished in the run."),
        stat("ETA", sel("relay_learner_eta_seconds"), h=5, unit="s",
             description="Estimated time until the env-step budget is spent."),
        panel(
            "timeseries", "Eval return (mean)",
            [t(sel("relay_eval_return_mean"), "{{run_id}} {{evaluator}}")],
            description="Mean return of each evaluation, by evaluator.",
        ),
        panel(
            "timeseries", "Training episode return",
            [
                t(sel("relay_episode_return_mean"), "{{run_id}} run (last 100)"),
                t(sel("relay_env_runner_episode_return_mean"), "{{run_id}} {{copy}} (last 100)"),
            ],
            description="Mean return of the last 100 training episodes, of the run and of each env-runner copy.",
        ),
        panel(
            "timeseries", "Each agent's return (parallel games, one shared policy)",
            [t(sel("relay_episode_agent_return_mean"), "{{run_id}} {{agent}}")],
            description="Mean return of each agent over the last 100 training games of a parallel PettingZoo game played by one shared policy; the training episode return is the team's, their sum.",
        ),
        panel(
            "timeseries", "Env steps per second",
            [
                t(f"sum by (run_id) (rate({sel('relay_env_runner_env_steps_total')}[{RI}]))",
                  "{{run_id}} collected (env-runners)"),
                t(f"sum by (run_id) ({sel('relay_learner_sps')})", "{{run_id}} trained (learner, since start)"),
            ],
            unit="ops",
            description="Env steps the env-runners take per second, and the learner's average training rate.",
        ),
        panel(
            "timeseries", "Progress",
            [t(sel("relay_learner_progress"), "{{run_id}}")],
            unit="percentunit", minimum=0, maximum=1,
            description="Fraction of the env-step budget spent.",
        ),
        panel(
            "timeseries", "Updates and policy version",
            [
                t(sel("relay_learner_updates"), "{{run_id}} updates"),
                t(sel("relay_learner_policy_version"), "{{run_id}} policy version"),
                t(sel("relay_eval_policy_version"), "{{run_id}} evaluated version ({{evaluator}})"),
            ],
            description="Updates made, the weights version they produced and the version last evaluated.",
        ),
        panel(
            "timeseries", "Active evaluators",
            [t(f"sum by (run_id, evaluator) ({sel('relay_evaluator_active')})", "{{run_id}} {{evaluator}}")],
            minimum=0, decimals=0,
            description="Evaluator copies running each plugin (relay eval use switches them; copies join and leave).",
        ),
        panel(
            "timeseries", "Updates and episodes per second",
            [
                t(f"deriv({sel('relay_learner_updates')}[{RI}])", "{{run_id}} updates/s"),
                t(f"rate({sel('relay_episodes_total')}[{RI}])", "{{run_id}} episodes/s"),
            ],
            unit="ops",
        ),
    ],
)

# --- learner internals --------------------------------------------------------

learner = dashboard(
    "relay-learner",
    "relay: learner internals",
    "PPO diagnostics of each update: losses, KL, clipping, ratios, value fit, gradients, schedules, timing, policy lag.",
    [
        panel("timeseries", "Policy loss", [t(sel("relay_learner_policy_loss"), "{{run_id}}")], w=6,
              description="Clipped surrogate loss, mean over the update's gradient steps."),
        panel("timeseries", "Value loss", [t(sel("relay_learner_value_loss"), "{{run_id}}")], w=6,
              description="Value loss (MSE to the GAE returns)."),
        panel("timeseries", "Entropy", [t(sel("relay_learner_entropy"), "{{run_id}}")], w=6,
              description="Mean policy entropy (nats)."),
        panel("timeseries", "Total loss", [t(sel("relay_learner_total_loss"), "{{run_id}}")], w=6,
              description="policy_loss - ent_coef * entropy + vf_coef * value_loss."),
        panel("timeseries", "Approx KL", [t(sel("relay_learner_approx_kl"), "{{run_id}}")], w=8,
              description="Approximate KL(old || new), mean((r - 1) - log r)."),
        panel(
            "timeseries", "Clip fractions",
            [
                t(sel("relay_learner_clip_fraction"), "{{run_id}} policy ratio clipped"),
                t(sel("relay_learner_value_clip_fraction"), "{{run_id}} value clipped"),
            ],
            w=8, unit="percentunit", minimum=0,
            description="Fraction of samples whose probability ratio (or value prediction) was clipped.",
        ),
        panel(
            "timeseries", "Probability ratio",
            [t(sel("relay_learner_ratio_mean"), "{{run_id}} mean"), t(sel("relay_learner_ratio_var"), "{{run_id}} variance")],
            w=8, right_axis=("B",),
            description="Mean (left axis) and variance (right axis) of the new/old probability ratio.",
        ),
        panel("timeseries", "Explained variance", [t(sel("relay_learner_explained_variance"), "{{run_id}}")], w=8,
              maximum=1, steps=thresholds("red", 0, "green"), threshold_style="line",
              description="Explained variance of the value predictions against the returns (1 is perfect, below 0 is worse than a constant)."),
        panel("timeseries", "Gradient norm", [t(sel("relay_learner_grad_norm"), "{{run_id}}")], w=8,
              description="Global gradient norm before clipping, mean over the update."),
        panel("timeseries", "Learning rate", [t(sel("relay_learner_learning_rate"), "{{run_id}}")], w=8,
              description="Learning rate, as scheduled."),
        panel("timeseries", "Clip range", [t(sel("relay_learner_clip_range"), "{{run_id}}")], w=8,
              description="PPO clip range, as scheduled."),
        panel(
            "timeseries", "Update time",
            quantiles("relay_learner_update_seconds") + [t(sel("relay_learner_last_update_seconds"), "{{run_id}} latest")],
            w=8, unit="s",
            description="Wall time of one PPO update: quantiles over the rate window, and the latest update.",
        ),
        panel(
            "timeseries", "KL early stops and epochs",
            [
                t(f"sum by (run_id) ({sel('relay_learner_kl_early_stops_total')})", "{{run_id}} early stops (total)"),
                t(sel("relay_learner_epochs"), "{{run_id}} epochs in the latest update"),
            ],
            w=8,
            description="Updates stopped early by ppo.target_kl, and the epochs the latest update ran.",
        ),
        panel(
            "timeseries", "Policy lag",
            quantiles("relay_policy_lag", qs=(0.5, 0.99)) + [t(sel("relay_learner_policy_lag_max"), "{{run_id}} max in the latest rollout")],
            w=12,
            description="Learner version minus the version that acted, per fragment trained on.",
        ),
        panel(
            "heatmap", "Policy lag distribution",
            [t(f"sum by (le) (increase({sel('relay_policy_lag_bucket')}[{RI}]))", "{{le}}", format="heatmap")],
            w=12,
            description="Fragments trained on per policy-lag bucket (versions).",
        ),
        row("Learner replicas"),
        panel(
            "timeseries", "Replicas and their steps",
            [
                t(f"max by (run_id) ({sel('relay_learner_replicas')})", "{{run_id}} replicas"),
                t(sel("relay_learner_replica_updates"), "{{copy}} updates"),
            ],
            w=8, right_axis=("B",),
            description="Learner replicas in the view (left axis) and the updates each replica has applied (right axis): replicas in step draw one line. Rank 0 gathers, publishes and checkpoints.",
        ),
        panel(
            "timeseries", "All-reduce time and size per update",
            [
                t(sel("relay_learner_allreduce_seconds"), "{{copy}} seconds"),
                t(sel("relay_learner_allreduce_bytes"), "{{copy}} bytes"),
            ],
            w=8, unit="s", right_axis=("B",),
            description="Time each replica spent summing gradients in its latest update (left axis) and the bytes summed (right axis); 0 for a single learner.",
        ),
        panel(
            "timeseries", "Wait at the step barrier",
            [t(sel("relay_learner_barrier_wait_seconds"), "{{copy}}")],
            w=8, unit="s",
            description="How long each replica waited for rank 0's step (rank 0: the time to hand it out). Followers that wait long are waiting for rank 0's data.",
        ),
    ],
)

# --- throughput and system ----------------------------------------------------

throughput = dashboard(
    "relay-throughput",
    "relay: throughput and system",
    "Where the time goes: env-runners, inference batching and latency, the replay buffer, backpressure, rejected messages and weights versions.",
    [
        row("Env-runners"),
        panel(
            "timeseries", "Env steps per second by env-runner",
            [
                t(f"sum by (replica) (rate({sel('relay_env_runner_env_steps_total')}[{RI}]))", "{{replica}}"),
                t(f"sum(rate({sel('relay_env_runner_env_steps_total')}[{RI}]))", "all env-runners"),
                t(sel("relay_env_runner_sps"), "{{copy}} (reported)"),
            ],
            w=8, unit="ops",
        ),
        panel(
            "timeseries", "Act latency (env-runner round trip)",
            quantiles("relay_env_runner_act_latency_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s",
            description="Round trip of one act request from an env-runner to the inference servers.",
        ),
        panel(
            "timeseries", "Rollout fragments by outcome",
            [t(f"sum by (outcome) (rate({sel('relay_env_runner_fragments_total')}[{RI}]))", "{{outcome}}")],
            w=8, unit="ops",
            description="Fragments the env-runners sent per second: stored, stale (dropped), refused, rejected.",
        ),
        panel(
            "timeseries", "Python env faults and worker restarts",
            [
                t(f"sum by (kind) (increase({sel('relay_env_runner_env_faults_total')}[{RI}]))", "{{kind}} (episodes dropped)"),
                t(f"sum(increase({sel('relay_env_runner_worker_restarts_total')}[{RI}]))", "worker restarts"),
            ],
            w=8,
            description="Envs stepped through the env bridge (Gymnasium in Python workers): episodes dropped by an exception in step (raised), a worker that exited (crashed) or went silent (hung), and workers restarted. Zero for relay's built-in envs.",
        ),
        panel(
            "timeseries", "Time per turn (vector step)",
            quantiles("relay_env_runner_step_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s",
            description="Wall time of one vector step: the act request plus stepping every env.",
        ),
        panel(
            "timeseries", "Time per episode",
            quantiles("relay_env_runner_episode_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s",
            description="Wall time of one episode, from its reset to its end.",
        ),
        row("Inference servers"),
        panel(
            "timeseries", "Inference batch size",
            quantiles("relay_inference_batch_size", by="replica", prefix="{{replica}} ") + [
                t(f"sum by (replica) (rate({sel('relay_inference_batch_size_sum')}[{RI}])) / "
                  f"sum by (replica) (rate({sel('relay_inference_batch_size_count')}[{RI}]))", "{{replica}} mean"),
            ],
            w=8,
            description="Observations per batched forward pass.",
        ),
        panel(
            "timeseries", "Queue depth (requests per batch)",
            quantiles("relay_inference_queue_depth", by="replica", prefix="{{replica}} "),
            w=24,
            description="Act requests that were waiting together when a batch was formed.",
        ),
        panel(
            "timeseries", "Forward latency",
            quantiles("relay_inference_forward_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s",
            description="Time of one batched forward pass.",
        ),
        panel(
            "timeseries", "Act requests per second",
            [t(f"sum by (replica) (rate({sel('relay_inference_requests_total', INF)}[{RI}]))", "{{replica}}")],
            w=8, unit="reqps",
        ),
        row("Replay buffer"),
        panel(
            "timeseries", "Replay size",
            [t(f"max by (run_id) ({sel('relay_replay_size_steps', RB)})", "{{run_id}} env steps held")],
            w=6,
            description="Env steps held in the on-policy FIFO (replay.capacity_steps bounds it).",
        ),
        panel(
            "timeseries", "Replay inserted and sampled",
            [
                t(f"sum(rate({sel('relay_replay_inserted_steps_total', RB)}[{RI}]))", "inserted"),
                t(f"sum(rate({sel('relay_replay_sampled_steps_total', RB)}[{RI}]))", "sampled"),
            ],
            w=6, unit="ops",
            description="Env steps stored and handed to the learner per second.",
        ),
        panel(
            "timeseries", "Dropped fragments",
            [
                t(f"sum by (reason) (rate({sel('relay_replay_dropped_fragments_total')}[{RI}]))", "replay: {{reason}}"),
                t(f"sum(rate({sel('relay_learner_dropped_stale_fragments_total')}[{RI}]))", "learner: stale"),
            ],
            w=6, unit="ops",
            description="Fragments dropped per second by the replay buffer (stale, undecodable) and by the learner (stale).",
        ),
        panel(
            "timeseries", "Backpressure",
            [
                t(f"sum(rate({sel('relay_env_runner_backpressure_waits_total')}[{RI}]))", "env-runner waits"),
                t(f"sum(rate({sel('relay_replay_refused_full_total')}[{RI}]))", "replay refused (full)"),
            ],
            w=6, unit="ops",
            description="Inserts refused because the replay buffer was full, per second.",
        ),
        row("Messages and weights"),
        panel(
            "timeseries", "Messages rejected",
            [
                t(f"sum by (service, subject, reason) ({sel('relay_messages_rejected_total')})",
                  "{{service}} {{subject}} {{reason}} (total)"),
                t(f"sum by (service, subject, reason) (increase({sel('relay_messages_rejected_total')}[{RI}]))",
                  "{{service}} {{subject}} {{reason}} (in window)"),
            ],
            w=12, steps=thresholds("green", 1, "red"), threshold_style="line",
            description="Received messages refused, by service, subject topic and reason (decode, schema_version, shape, "
                        "non_finite, invalid, oversized). A series appears with the first rejection.",
        ),
        panel(
            "timeseries", "Weights version by service",
            [
                t(sel("relay_learner_weights_version"), "learner (published)"),
                t(sel("relay_inference_weights_version", 'service="inference-server"'), "{{replica}} (served)"),
                t(sel("relay_env_runner_policy_version"), "{{copy}} (acted)"),
                t(sel("relay_eval_policy_version"), "evaluator {{evaluator}} (evaluated)"),
            ],
            w=12,
            description="The weights version each service holds: a copy far behind the learner is lagging.",
        ),
        panel(
            "timeseries", "Evaluator skipped versions",
            [t(f"sum(increase({sel('relay_evaluator_skipped_versions_total')}[{RI}]))", "skipped in window")],
            w=12,
            description="Weights versions the evaluator skipped because newer ones arrived.",
        ),
    ],
)

# --- alerts -------------------------------------------------------------------

# The tracker raises alerts (services/tracker/src/alerts.rs); relay_alert_active
# and relay_alerts_raised_total have a series once an alert was raised. The
# context panels draw the bounds that the alert rules use.
alerts = dashboard(
    "relay-alerts",
    "relay: alerts",
    "Alerts the tracker raises on the reported metrics, and the metrics they watch.",
    [
        stat("Active alerts", f"count({sel('relay_alert_active')} == 1) or vector(0)", "active", w=4, h=8,
             steps=thresholds("green", 1, "red"), description="Alerts raised and not cleared."),
        panel(
            "state-timeline", "Alert state",
            [t(f"max by (alert, metric) ({sel('relay_alert_active')})", "{{alert}} {{metric}}")],
            w=20, h=8,
            mappings=[{"type": "value", "options": {"0": {"text": "ok", "color": "green"}, "1": {"text": "raised", "color": "red"}}}],
            steps=thresholds("green", 1, "red"),
            description="relay_alert_active{alert,metric}: 1 while raised, 0 once cleared.",
        ),
        panel(
            "table", "Alerts now",
            [t(f"max by (alert, metric) ({sel('relay_alert_active')})", "", instant=True, range=False, format="table")],
            w=12, h=8,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True},
                                                             "renameByName": {"Value": "active"}}}],
        ),
        panel(
            "timeseries", "Alerts raised",
            [t(f"sum by (alert) ({sel('relay_alerts_raised_total')})", "{{alert}}")],
            w=12, h=8,
            description="Times each alert was raised (cumulative).",
        ),
        row("What the alerts watch"),
        panel("timeseries", "Approx KL (alert outside 1e-3 .. 5e-2)", [t(sel("relay_learner_approx_kl"), "{{run_id}}")], w=8,
              steps=thresholds("red", 0.001, "green", 0.05, "red"), threshold_style="line+area"),
        panel("timeseries", "Clip fraction (alert outside 0.05 .. 0.5)", [t(sel("relay_learner_clip_fraction"), "{{run_id}}")], w=8,
              unit="percentunit", steps=thresholds("red", 0.05, "green", 0.5, "red"), threshold_style="line+area"),
        panel("timeseries", "Explained variance (alert below 0)", [t(sel("relay_learner_explained_variance"), "{{run_id}}")], w=8,
              steps=thresholds("red", 0, "green"), threshold_style="line+area"),
        panel("timeseries", "Entropy (alert on collapse)", [t(sel("relay_learner_entropy"), "{{run_id}}")], w=8,
              description="entropy_collapse: smoothed entropy under a quarter of its initial mean."),
        panel("timeseries", "Training return (alert when stalled or declining)",
              [t(sel("relay_episode_return_mean"), "{{run_id}}")], w=8),
        panel("timeseries", "Learner env steps per second (alert when stalled)",
              [t(f"deriv({sel('relay_learner_env_steps')}[{RI}])", "{{run_id}}")], w=8, unit="ops",
              description="step_stalled: learner_env_steps has not grown for a minute while training."),
    ],
)

# --- text games and LLM generation --------------------------------------------

games = dashboard(
    "relay-games",
    "relay: text games and generation",
    "LLM policies playing text games: outcomes and legal moves in training games and evaluations, game timing, and the inference servers' batched generation.",
    [
        row("Training games (env-runners)"),
        panel(
            "timeseries", "Win / draw / loss rate (last 100 games)",
            [
                t(sel("relay_env_runner_win_rate"), "{{copy}} win"),
                t(sel("relay_env_runner_draw_rate"), "{{copy}} draw"),
                t(sel("relay_env_runner_loss_rate"), "{{copy}} loss"),
            ],
            w=8, unit="percentunit", minimum=0, maximum=1,
            description="The learning seat's outcomes over each env-runner copy's last 100 games.",
        ),
        panel(
            "timeseries", "Invalid-move rate (last 1000 moves)",
            [t(sel("relay_env_runner_invalid_move_rate"), "{{copy}}")],
            w=8, unit="percentunit", minimum=0,
            description="Share of the learning policy's moves the game refused.",
        ),
        panel(
            "timeseries", "Answers: missing, illegal, truncated thought",
            [
                t(f"sum(rate({sel('relay_env_runner_no_answer_total')}[{RI}])) / sum(rate({sel('relay_env_runner_model_moves_total')}[{RI}]))", "no answer"),
                t(f"sum(rate({sel('relay_env_runner_illegal_answers_total')}[{RI}])) / sum(rate({sel('relay_env_runner_model_moves_total')}[{RI}]))", "illegal answer"),
                t(f"sum(rate({sel('relay_env_runner_truncated_thoughts_total')}[{RI}])) / sum(rate({sel('relay_env_runner_model_moves_total')}[{RI}]))", "truncated thought"),
            ],
            w=8, unit="percentunit", minimum=0,
            description="Shares of the learning policy's moves whose reply held no answer in the run's answer format (text.answer), whose answer the game refused, and whose thought reached text.max_turn_tokens before the answer.",
        ),
        panel(
            "timeseries", "Games per minute by game, opponent and outcome",
            [t(f"60 * sum by (game, opponent, outcome) (rate({sel('relay_env_runner_games_total')}[{RI}]))",
               "{{game}} {{opponent}} {{outcome}}")],
            w=8,
            description="Finished training games; abandoned games are counted apart.",
        ),
        panel(
            "timeseries", "Time per model move",
            quantiles("relay_env_runner_turn_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s", description="Generate request(s) plus the game's step, per model move.",
        ),
        panel(
            "timeseries", "Time per game",
            quantiles("relay_env_runner_game_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s",
        ),
        panel(
            "timeseries", "Move entropy and distinct states",
            [
                t(sel("relay_env_runner_move_entropy"), "{{copy}} move entropy (bits)"),
                t(f"log2({sel('relay_env_runner_distinct_states')})", "{{copy}} log2 distinct states"),
            ],
            w=8,
            description="Diversity of play: entropy of the last 1000 valid moves, and the states seen so far.",
        ),
        row("Per game (text.games; single-game runs show their one game)"),
        panel(
            "timeseries", "Games per minute by game",
            [t(f"60 * sum by (game) (rate({sel('relay_text_games_total')}[{RI}]))", "{{game}}")],
            w=8, minimum=0,
            description="Finished training games of each text game: the sampling weights of text.games at work.",
        ),
        panel(
            "timeseries", "Win / draw / loss rate by game (last 100 games)",
            [
                t(f"avg by (game) ({sel('relay_env_runner_game_win_rate')})", "{{game}} win"),
                t(f"avg by (game) ({sel('relay_env_runner_game_draw_rate')})", "{{game}} draw"),
                t(f"avg by (game) ({sel('relay_env_runner_game_loss_rate')})", "{{game}} loss"),
            ],
            w=8, unit="percentunit", minimum=0, maximum=1,
            description="The learning seat's outcomes per game, averaged over env-runner copies.",
        ),
        panel(
            "timeseries", "Mean return by game (last 100 games)",
            [
                t(f"avg by (game) ({sel('relay_env_runner_game_return_mean')})", "{{game}} training games"),
                t(f"avg by (game) ({sel('relay_learner_game_reward_mean')})", "{{game}} learner batch"),
            ],
            w=8,
            description="Each game's own reward scale, before any normalisation (rl.reward.normalize works per game).",
        ),
        panel(
            "timeseries", "Legal-move rate by game",
            [
                t(f"avg by (game) ({sel('relay_env_runner_game_legal_move_rate')})", "{{game}} training games"),
                t(f"avg by (game) ({sel('relay_learner_game_legal_move_rate')})", "{{game}} learner batch"),
            ],
            w=8, unit="percentunit", minimum=0, maximum=1,
        ),
        panel(
            "timeseries", "Episode length by game",
            [t(f"avg by (game) ({sel('relay_env_runner_game_length_mean')})", "{{game}}")],
            w=8, minimum=0, description="Mean turns (every seat's) of each game's last 100 games.",
        ),
        panel(
            "timeseries", "Sequences trained per minute by game",
            [t(f"60 * sum by (game) (rate({sel('relay_learner_game_examples_total')}[{RI}]))", "{{game}}")],
            w=8, minimum=0, description="Learning moves of each game turned into training sequences.",
        ),
        row("Evaluation against fixed opponents"),
        panel(
            "timeseries", "Eval outcome rate by game and opponent",
            [t(sel("relay_eval_outcome_rate"), "{{game}} {{opponent}} {{outcome}} ({{evaluator}})")],
            w=12, unit="percentunit", minimum=0, maximum=1,
            description="Latest evaluation's games against each opponent, both seats together.",
        ),
        panel(
            "timeseries", "Eval legal-move rate by game and opponent",
            [t(sel("relay_eval_legal_move_rate"), "{{game}} {{opponent}} ({{evaluator}})")],
            w=12, unit="percentunit", minimum=0, maximum=1,
        ),
        row("Token-level learner"),
        panel(
            "timeseries", "Loss, KL to the base model, entropy",
            [
                t(sel("relay_learner_loss"), "{{run_id}} loss"),
                t(sel("relay_learner_kl_ref"), "{{run_id}} KL to reference"),
                t(sel("relay_learner_entropy"), "{{run_id}} entropy"),
                t(sel("relay_learner_kl_penalty"), "{{run_id}} KL penalty (non-score reward)"),
            ],
            w=8, description="Per update: the objective, the KL of the adapted model to the base (objective/kl), the token entropy (objective/entropy), the reward-mode KL penalty.",
        ),
        panel(
            "timeseries", "Policy movement per update (rl.epochs > 1)",
            [
                t(sel("relay_learner_approx_kl"), "{{run_id}} approx KL from the sampler"),
                t(sel("relay_learner_epoch_kl"), "{{run_id}} approx KL between epochs"),
                t(sel("relay_learner_clip_fraction"), "{{run_id}} clip fraction"),
            ],
            w=8,
            description="Text runs taking several steps per batch: mean((r - 1) - log r) of the learner's policy against the one that sampled the batch, and between consecutive epochs of one update; the share of tokens PPO's clip held. Not reported with one epoch.",
        ),
        panel(
            "timeseries", "Rewards of the trained moves",
            [
                t(sel("relay_learner_reward_mean"), "{{run_id}} game reward (score)"),
                t(sel("relay_learner_shaped_reward_mean"), "{{run_id}} shaped reward"),
                t(sel("relay_learner_rlhf_reward"), "{{run_id}} RLHF reward (shaped minus KL penalty)"),
            ],
            w=8, description="Mean game result of the learning seats, and after rl.reward shaping (format bonus, invalid-move penalty, normalisation).",
        ),
        panel(
            "timeseries", "Format, legal moves, EOS",
            [
                t(sel("relay_learner_format_rate"), "{{run_id}} answers found (format)"),
                t(sel("relay_learner_legal_move_rate"), "{{run_id}} legal moves (correctness)"),
                t(sel("relay_learner_eos_rate"), "{{run_id}} completions ending on EOS"),
            ],
            w=8, unit="percentunit", minimum=0, maximum=1,
        ),
        panel(
            "timeseries", "Sequence lengths",
            [
                t(sel("relay_learner_mean_seq_len"), "{{run_id}} train sequence"),
                t(sel("relay_learner_completion_len"), "{{run_id}} completion (output)"),
            ],
            w=8, description="Mean prompt + completion tokens trained on, and completion tokens alone.",
        ),
        panel(
            "timeseries", "Training tokens per second",
            [t(sel("relay_learner_tokens_per_second"), "{{run_id}}")],
            w=8, unit="ops",
        ),
        panel(
            "timeseries", "Truncated sequences and tokens cut",
            [
                t(f"sum by (run_id) (increase({sel('relay_learner_truncated_sequences_total')}[{RI}]))", "{{run_id}} sequences truncated"),
                t(f"sum by (run_id) (increase({sel('relay_learner_tokens_cut_total')}[{RI}]))", "{{run_id}} tokens cut"),
            ],
            w=8, minimum=0,
            description="Sequences longer than rl.max_seq_len lose the start of their prompt.",
        ),
        panel(
            "timeseries", "Sampler vs learner log-probs",
            [
                t(sel("relay_learner_sampler_logprob_diff_mean"), "{{run_id}} mean |learner - sampler|"),
                t(sel("relay_learner_sampler_logprob_diff_max"), "{{run_id}} max |learner - sampler|"),
                t(sel("relay_learner_tis_capped_fraction"), "{{run_id}} tokens capped (truncated IS)"),
            ],
            w=8, minimum=0,
            description="Per update: how far the learner's log-probs of the sampled tokens (before the update) are from the inference servers' (nats), and the share of tokens whose importance weight rl.truncated_is.cap cut.",
        ),
        row("Generation (inference servers)"),
        panel(
            "timeseries", "Completion tokens per second",
            [
                t(f"sum by (replica) (rate({sel('relay_llm_generated_tokens_total')}[{RI}]))", "{{replica}}"),
                t(f"sum(rate({sel('relay_llm_generated_tokens_total')}[{RI}]))", "all inference servers"),
            ],
            w=8, unit="ops",
        ),
        panel(
            "timeseries", "Sequences per decode step",
            quantiles("relay_llm_sequences_per_step", by="replica", prefix="{{replica}} "),
            w=8, description="Size of the continuous batch each decode step advanced.",
        ),
        panel(
            "timeseries", "Generate requests waiting",
            [t(sel("relay_llm_queue_depth"), "{{replica}}")],
            w=8, minimum=0, decimals=0,
            description="Requests waiting for a place in the continuous batch (llm.max_sequences).",
        ),
        panel(
            "timeseries", "Time to first token",
            quantiles("relay_llm_time_to_first_token_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s",
        ),
        panel(
            "timeseries", "Generate request latency",
            quantiles("relay_llm_request_seconds", by="replica", prefix="{{replica}} "),
            w=8, unit="s",
        ),
        panel(
            "timeseries", "LoRA adapters",
            [
                t(sel("relay_llm_adapters_loaded"), "{{replica}} loaded"),
                t(f"sum by (replica) (increase({sel('relay_llm_adapter_loads_total')}[{RI}]))", "{{replica}} loads"),
                t(f"sum by (replica) (increase({sel('relay_llm_adapter_evictions_total')}[{RI}]))", "{{replica}} evictions"),
            ],
            w=8, minimum=0,
            description="Adapter versions held (bounded by llm.max_adapters), loaded and evicted.",
        ),
    ],
)

# --- league -------------------------------------------------------------------

WON = 'outcome="win"'

# The league of game-playing runs: TrueSkill ratings per player and games by
# outcome, exported by the tracker from the run's pool in Redis.
league = dashboard(
    "relay-league",
    "relay: league",
    "Self-play league (games): TrueSkill ratings per player and games played, from the run's league pool.",
    [
        panel("timeseries", "Rating mu by player", [t(sel("relay_league_rating_mu"), "{{player}}")], w=12,
              description="TrueSkill mean rating of each player (policy snapshot)."),
        panel("timeseries", "Rating sigma by player", [t(sel("relay_league_rating_sigma"), "{{player}}")], w=12,
              description="TrueSkill rating uncertainty of each player."),
        panel("timeseries", "Conservative rating (mu - 3 sigma)",
              [t(f"{sel('relay_league_rating_mu')} - 3 * {sel('relay_league_rating_sigma')}", "{{player}}")], w=12),
        panel("timeseries", "Games per minute by player and outcome",
              [t(f"60 * sum by (player, outcome) (rate({sel('relay_league_games_total')}[{RI}]))",
                 "{{player}} {{outcome}}")], w=12,
              description="Each league game counts once for each of its two players."),
        panel(
            "table", "Ratings now",
            [
                t(f"max by (player) ({sel('relay_league_rating_mu')})", "", instant=True, range=False, format="table"),
                t(f"max by (player) ({sel('relay_league_rating_sigma')})", "", instant=True, range=False, format="table"),
            ],
            w=24,
            transformations=[
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {"excludeByName": {"Time": True},
                                               "renameByName": {"Value #A": "mu", "Value #B": "sigma"}}},
                {"id": "sortBy", "options": {"sort": [{"field": "mu", "desc": True}]}},
            ],
        ),
        panel("timeseries", "Opponent sampling: games per minute by opponent and sampler",
              [t(f"60 * sum by (opponent, sampler) (rate({sel('relay_league_opponent_games_total')}[{RI}]))",
                 "{{opponent}} ({{sampler}})")], w=12,
              description="League training games by the opponent they had (self: mirror, past: a past version, "
                          "or a fixed bot) and the sampler rule that drew it: how often each kind of opponent is played."),
        panel("timeseries", "Mirror fallbacks per minute by reason",
              [t(f"60 * sum by (reason) (rate({sel('relay_league_mirror_fallbacks_total')}[{RI}]))", "{{reason}}")],
              w=12,
              description="League games played as mirror games instead of the drawn opponent "
                          "(e.g. not_served: no inference server could serve the past version)."),
        panel("timeseries", "Opponent lag (versions behind the learning adapter)",
              quantiles("relay_league_opponent_lag_versions", by="run_id"), w=12,
              description="How far back the past versions played in rated league games are."),
        panel("timeseries", "Self-play games per minute by opponent and outcome (games on observations)",
              [t(f"60 * sum by (opponent, outcome) (rate({sel('relay_env_runner_selfplay_games_total')}[{RI}]))",
                 "{{opponent}} {{outcome}}")], w=12,
              description="Training games of a PettingZoo game by the opponent the learning seat had "
                          "(mirror, a bot, league:mirror, league:past, league:<bot>) and its outcome."),
        panel("timeseries", "vs-opponent evaluation: share of games won by opponent and seat",
              [t(f"sum by (game, opponent, seat) ({sel('relay_evaluator_games', WON)}) / "
                 f"sum by (game, opponent, seat) ({sel('relay_evaluator_games')})",
                 "{{game}} vs {{opponent}} seat {{seat}}")], w=12, unit="percentunit", minimum=0, maximum=1,
              description="The latest vs-opponent evaluation of the policy, from each seat against each opponent."),
    ],
)


def main():
    OUT.mkdir(exist_ok=True)
    for name, d in [
        ("training.json", training),
        ("learner.json", learner),
        ("throughput.json", throughput),
        ("alerts.json", alerts),
        ("games.json", games),
        ("league.json", league),
    ]:
        (OUT / name).write_text(json.dumps(d, indent=2) + "\n")
        print(f"wrote {OUT / name}: {len(d['panels'])} panels")


if __name__ == "__main__":
    main()
