//! Drawing `relay top` with ratatui: header, progress, training, eval,
//! services, league and alerts panels.

use super::*;

pub(crate) fn fmt_opt(value: Option<f64>, precision: usize) -> String {
    match value {
        Some(v) if v.is_finite() => format!("{v:.precision$}"),
        Some(v) => v.to_string(),
        None => "-".to_string(),
    }
}

pub(crate) fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

pub(crate) fn status_name(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Running => "running",
        RunStatus::Solved => "solved",
        RunStatus::Stopped => "stopped",
        RunStatus::Failed => "failed",
    }
}

pub(crate) fn panel(title: &str) -> Block<'static> {
    Block::bordered().title(Span::styled(
        format!(" {title} "),
        Style::default().add_modifier(Modifier::BOLD),
    ))
}

/// Renders the whole screen from `state`; no I/O.
pub fn draw(frame: &mut Frame, state: &TopState) {
    let [header, progress, middle, bottom, footer] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Length(3),
        Constraint::Length(17),
        Constraint::Min(5),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    draw_header(frame, header, state);
    draw_progress(frame, progress, state);
    let [training, eval] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(middle);
    draw_training(frame, training, state);
    draw_eval(frame, eval, state);
    if state.league.is_empty() {
        let [services, alerts] =
            Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                .areas(bottom);
        draw_services(frame, services, state);
        draw_alerts(frame, alerts, state);
    } else {
        let [services, alerts, league] = Layout::horizontal([
            Constraint::Percentage(45),
            Constraint::Percentage(25),
            Constraint::Percentage(30),
        ])
        .areas(bottom);
        draw_services(frame, services, state);
        draw_alerts(frame, alerts, state);
        draw_league(frame, league, state);
    }
    let source = if state.health.is_some() {
        "health: /healthz of the stack record"
    } else {
        "health: metric reports (no stack record of this run)"
    };
    frame.render_widget(
        Paragraph::new(format!(
            " q / Esc / Ctrl-C quit · refreshed each second · {source}"
        ))
        .style(Style::default().fg(Color::DarkGray)),
        footer,
    );
}

pub(crate) fn draw_header(frame: &mut Frame, area: Rect, state: &TopState) {
    let status = match (&state.status, state.last_message) {
        (Some(s), _) => {
            let mut text = format!("{} ({})", status_name(s.status), s.service);
            if !s.detail.is_empty() {
                text.push_str(": ");
                text.push_str(&s.detail);
            }
            text
        }
        (None, Some(_)) => "running".to_string(),
        (None, None) => "waiting for messages".to_string(),
    };
    let status_color = match state.status.as_ref().map(|s| s.status) {
        Some(RunStatus::Solved) => Color::Green,
        Some(RunStatus::Failed) => Color::Red,
        Some(RunStatus::Stopped) => Color::Yellow,
        _ => Color::Reset,
    };
    let mut spans = vec![
        Span::raw("run "),
        Span::styled(
            state.run_id.clone(),
            Style::default().add_modifier(Modifier::BOLD),
        ),
        Span::raw("   status "),
        Span::styled(status, Style::default().fg(status_color)),
    ];
    if let Some(t) = state.last_message {
        let age = state.now.saturating_duration_since(t).as_secs_f64();
        spans.push(Span::raw(format!("   last message {age:.1}s ago")));
    }
    if let Some((url, connected)) = &state.nats {
        let (text, color) = if *connected {
            ("connected", Color::Reset)
        } else {
            ("disconnected", Color::Red)
        };
        spans.push(Span::raw(format!("   nats {url} ")));
        spans.push(Span::styled(text, Style::default().fg(color)));
    }
    frame.render_widget(
        Paragraph::new(Line::from(spans)).block(panel("relay top")),
        area,
    );
}

pub(crate) fn draw_progress(frame: &mut Frame, area: Rect, state: &TopState) {
    let sps = state.sps().map_or("-".to_string(), |s| format!("{s:.0}"));
    let eta = state.eta().map_or("-".to_string(), fmt_duration);
    let (ratio, label) = match (state.env_steps(), state.budget()) {
        (Some(steps), Some(budget)) if budget > 0 => {
            let ratio = (steps as f64 / budget as f64).clamp(0.0, 1.0);
            (
                ratio,
                format!(
                    "{steps} / {budget} env steps ({:.1}%)   SPS {sps}   ETA {eta}",
                    ratio * 100.0
                ),
            )
        }
        (Some(steps), _) => (0.0, format!("{steps} env steps   SPS {sps}")),
        (None, _) => (0.0, "waiting for the learner's first update".to_string()),
    };
    frame.render_widget(
        Gauge::default()
            .block(panel("progress"))
            .gauge_style(Style::default().fg(Color::Cyan).bg(Color::Black))
            .ratio(ratio)
            .label(label),
        area,
    );
}

pub(crate) fn draw_training(frame: &mut Frame, area: Rect, state: &TopState) {
    let g = |name: &str, precision: usize| fmt_opt(state.gauge(name), precision);
    let runner_sps = state.across("env-runner", "env_runner_sps", UP_WITHIN);
    let returns = state.across("env-runner", "env_runner_episode_return_mean", COPY_WINDOW);
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let rows: [(&str, String); 15] = [
        ("updates", g("learner_updates", 0)),
        ("policy version", g("learner_policy_version", 0)),
        ("policy loss", g("learner_policy_loss", 4)),
        ("value loss", g("learner_value_loss", 4)),
        ("entropy", g("learner_entropy", 4)),
        ("approx kl", g("learner_approx_kl", 5)),
        ("clip fraction", g("learner_clip_fraction", 3)),
        ("explained variance", g("learner_explained_variance", 3)),
        (
            "learning rate",
            state
                .gauge("learner_learning_rate")
                .map_or("-".to_string(), |v| format!("{v:.2e}")),
        ),
        ("replay size (steps)", g("replay_size_steps", 0)),
        ("policy lag (max)", g("learner_policy_lag_max", 0)),
        ("train return (mean)", fmt_opt(mean(&returns), 1)),
        (
            "env-runner sps",
            fmt_opt((!runner_sps.is_empty()).then(|| runner_sps.iter().sum()), 0),
        ),
        ("inference weights", g("inference_weights_version", 0)),
        ("learner update (s)", g("learner_last_update_seconds", 3)),
    ];
    let lines: Vec<Line> = rows
        .into_iter()
        .map(|(name, value)| {
            Line::from(vec![
                Span::styled(format!("{name:<22}"), Style::default().fg(Color::DarkGray)),
                Span::raw(value),
            ])
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).block(panel("learner")), area);
}

pub(crate) fn draw_eval(frame: &mut Frame, area: Rect, state: &TopState) {
    let block = panel("eval return");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let [text, chart] = Layout::vertical([Constraint::Length(5), Constraint::Min(1)]).areas(inner);
    let mut lines = match state.last_eval() {
        Some(e) => {
            let (word, color) = if e.solved {
                ("solved", Color::Green)
            } else {
                ("not solved", Color::Reset)
            };
            vec![
                Line::from(vec![
                    Span::raw("latest mean "),
                    Span::styled(
                        format!("{:.1}", e.mean_return),
                        Style::default().add_modifier(Modifier::BOLD),
                    ),
                    Span::raw(format!(
                        " ± {:.1}  at v{} ({} env steps)",
                        e.std_return, e.policy_version, e.learner_env_steps
                    )),
                ]),
                Line::from(vec![
                    Span::raw(format!("threshold {:.1}   ", e.threshold)),
                    Span::styled(word, Style::default().fg(color)),
                ]),
                Line::from(format!(
                    "best {}   evals {}",
                    fmt_opt(state.best_eval, 1),
                    state.evals.len()
                )),
            ]
        }
        None => vec![Line::from("no evaluation yet")],
    };
    let active: Vec<String> = state
        .active_evaluators()
        .map(|(instance, e)| format!("{} {} v{}", e.evaluator, instance, e.policy_version))
        .collect();
    if !active.is_empty() {
        lines.push(Line::from(format!("evaluators: {}", active.join(" · "))));
    }
    frame.render_widget(Paragraph::new(lines).wrap(Wrap { trim: true }), text);
    // Bars from the lowest to the highest of the history and the threshold,
    // so the threshold is the top of the chart until a run passes it.
    let threshold = state
        .last_eval()
        .map(|e| e.threshold)
        .filter(|t| t.is_finite());
    let values: Vec<f64> = state.eval_history().collect();
    if values.is_empty() {
        return;
    }
    let lo = values
        .iter()
        .chain(&threshold)
        .copied()
        .fold(f64::INFINITY, f64::min);
    let hi = values
        .iter()
        .chain(&threshold)
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    let span = (hi - lo).max(1e-9);
    let width = usize::from(chart.width);
    let bars: Vec<u64> = values[values.len().saturating_sub(width)..]
        .iter()
        .map(|v| 1 + ((v - lo) / span * 100.0).round() as u64)
        .collect();
    frame.render_widget(
        Sparkline::default()
            .data(bars)
            .max(101)
            .style(Style::default().fg(Color::Green)),
        chart,
    );
}

pub(crate) fn draw_services(frame: &mut Frame, area: Rect, state: &TopState) {
    let replicas = state.learner_replicas();
    let rows: Vec<Row> = state
        .services()
        .into_iter()
        .flat_map(|row| {
            let problems: Vec<String> = row
                .copies
                .iter()
                .filter_map(|(name, s)| match s {
                    CopyState::Up => None,
                    CopyState::Unhealthy(code) => Some(format!("{name} http {code}")),
                    CopyState::Down => Some(format!("{name} down")),
                    CopyState::Silent(age) => Some(format!("{name} silent {}s", age.as_secs())),
                })
                .collect();
            let up = row.up();
            let (health, color) = if problems.is_empty() {
                ("ok".to_string(), Color::Green)
            } else if up == 0 {
                (problems.join(", "), Color::Red)
            } else {
                (problems.join(", "), Color::Yellow)
            };
            let mut lines = vec![Row::new(vec![
                Cell::from(row.service.clone()),
                Cell::from(row.copies.len().to_string()),
                Cell::from(up.to_string()),
                Cell::from(health).style(Style::default().fg(color)),
            ])];
            if row.service == "learner" {
                // One line per data-parallel replica, by rank.
                lines.extend(replicas.iter().map(|r| {
                    let secs = |v: Option<f64>| fmt_opt(v, 2);
                    Row::new(vec![
                        Cell::from(format!(" {}", r.instance)),
                        Cell::from(format!("rank {}", r.rank)),
                        Cell::from(""),
                        Cell::from(format!(
                            "step {}, reduce {}s, wait {}s",
                            r.updates.map_or("-".to_string(), |u| u.to_string()),
                            secs(r.allreduce_seconds),
                            secs(r.barrier_wait_seconds),
                        ))
                        .style(Style::default().fg(Color::DarkGray)),
                    ])
                }));
            }
            lines
        })
        .collect();
    let empty = rows.is_empty();
    let table = Table::new(
        rows,
        [
            Constraint::Length(18),
            Constraint::Length(6),
            Constraint::Length(4),
            Constraint::Fill(1),
        ],
    )
    .header(
        Row::new(vec!["service", "copies", "up", "health"])
            .style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(panel("services"));
    frame.render_widget(table, area);
    if empty {
        let inner = panel("services").inner(area);
        if inner.height > 1 {
            let below = Rect {
                y: inner.y + 1,
                height: 1,
                ..inner
            };
            frame.render_widget(Paragraph::new("no service seen yet"), below);
        }
    }
}

pub(crate) fn draw_league(frame: &mut Frame, area: Rect, state: &TopState) {
    let mut lines = vec![Line::styled(
        format!("{:<12} {:>7} {:>6} {:>6}", "player", "mu", "sigma", "games"),
        Style::default().add_modifier(Modifier::BOLD),
    )];
    lines.extend(state.league.iter().map(|row| {
        Line::raw(format!(
            "{:<12} {:>7.2} {:>6.2} {:>6}",
            row.player, row.mu, row.sigma, row.games
        ))
    }));
    let title = format!("league ({} members, TrueSkill)", state.league.len());
    frame.render_widget(Paragraph::new(lines).block(panel(&title)), area);
}

pub(crate) fn draw_alerts(frame: &mut Frame, area: Rect, state: &TopState) {
    let lines: Vec<Line> = state
        .active_alerts()
        .map(|a| {
            Line::from(vec![
                Span::styled(
                    a.alert.clone(),
                    Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
                ),
                Span::raw(format!(" {}={:.4}: {}", a.metric, a.value, a.message)),
            ])
        })
        .collect();
    let title = format!("alerts ({} active)", lines.len());
    let body = if lines.is_empty() {
        Paragraph::new("none")
    } else {
        Paragraph::new(lines).wrap(Wrap { trim: true })
    };
    frame.render_widget(body.block(panel(&title)), area);
}
