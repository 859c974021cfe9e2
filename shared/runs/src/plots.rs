//! Learning curves of a run as PNG files: `runs/<id>/plots/`
//!
//! - `return.png`: the training return (each env-runner copy's mean of its
//!   last 100 episodes, `env_runner_episode_return_mean` in `metrics.jsonl`;
//!   without it, the run's rolling mean of 100 episodes from
//!   `episodes.jsonl`) and the eval mean return (± one standard deviation,
//!   `eval.jsonl`), with the solved threshold;
//! - `losses.png`: `learner_policy_loss`, `learner_value_loss` and
//!   `learner_entropy`, one panel each;
//! - `sps.png`: `learner_sps` and each env-runner copy's `env_runner_sps`.
//!
//! The x axis is the vector steps the policy had been trained on: for the
//! learner's values, its report's `vec_steps`; for an eval, a training
//! episode or an env-runner's values, the learner's `vec_steps` when it
//! published the weights version that acted (`policy_version`,
//! `env_runner_policy_version`; one point per copy and version, the latest).
//! Env-runners take more steps than the learner trains on (stale fragments
//! are dropped), so their own step counts would put their curves ahead of
//! the learner's and the evaluator's. An env-runner report without a
//! version sits at its own `vec_steps`.
//!
//! Drawn by the tracker at shutdown and by `relay plot`. Text uses DejaVu
//! Sans compiled in (the `dejavu` crate) through plotters' `ab_glyph`
//! backend: no system font is needed. Lines of the JSONL files that do not
//! parse (a torn last line) are skipped.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

/// Why the plots could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PlotError(String);

fn err(context: impl std::fmt::Display) -> impl FnOnce(&dyn std::fmt::Display) -> PlotError {
    move |e| PlotError(format!("{context}: {e}"))
}

/// Named points, sorted by x.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One evaluation: x, mean return, standard deviation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalPoint {
    pub x: f64,
    pub mean: f64,
    pub std: f64,
}

/// Everything the plots show, read from a run directory.
#[derive(Debug, Clone, Default)]
pub struct Curves {
    pub train_return: Vec<Series>,
    /// One series of points per evaluator.
    pub eval_return: Vec<(String, Vec<EvalPoint>)>,
    pub threshold: Option<f64>,
    pub policy_loss: Vec<(f64, f64)>,
    pub value_loss: Vec<(f64, f64)>,
    pub entropy: Vec<(f64, f64)>,
    pub sps: Vec<Series>,
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn finite(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}

/// Per-label series, in first-seen order.
#[derive(Default)]
struct Grouped {
    order: Vec<String>,
    points: HashMap<String, Vec<(f64, f64)>>,
}

impl Grouped {
    fn push(&mut self, label: &str, point: (f64, f64)) {
        if !self.points.contains_key(label) {
            self.order.push(label.to_string());
        }
        let points = self.points.entry(label.to_string()).or_default();
        // One point per x: the latest value there.
        match points.last_mut() {
            Some(last) if last.0 == point.0 => *last = point,
            _ => points.push(point),
        }
    }
    fn into_series(mut self) -> Vec<Series> {
        self.order
            .into_iter()
            .map(|label| {
                let mut points = self.points.remove(&label).unwrap_or_default();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series { label, points }
            })
            .collect()
    }
}

impl Curves {
    /// Reads `metrics.jsonl`, `eval.jsonl` and `episodes.jsonl` of a run
    /// directory (missing files count as empty).
    pub fn load(run_dir: &Path) -> Self {
        let mut curves = Curves::default();
        let metrics = jsonl(&run_dir.join("metrics.jsonl"));
        // The learner's reports: weights version -> vec_steps it had trained on.
        let mut versions: BTreeMap<u64, f64> = BTreeMap::new();
        // Learner vec_steps per env step, for evals of unknown versions.
        let mut vec_per_env: Option<f64> = None;
        for line in &metrics {
            let values = &line["values"];
            let get = |name: &str| finite(&values[name]);
            let Some(x) = get("learner_vec_steps").or_else(|| finite(&line["vec_steps"])) else {
                continue;
            };
            if let Some(v) = get("learner_policy_version") {
                versions.insert(v as u64, x);
            }
            if let Some(env) = get("learner_env_steps").filter(|e| *e > 0.0) {
                vec_per_env = Some(x / env);
            }
            for (name, out) in [
                ("learner_policy_loss", &mut curves.policy_loss),
                ("learner_value_loss", &mut curves.value_loss),
                ("learner_entropy", &mut curves.entropy),
            ] {
                if let Some(y) = get(name) {
                    out.push((x, y));
                }
            }
        }
        // The newest known version at or before `v` (version 0, the initial
        // weights, is at 0).
        let at_version = |v: u64| -> Option<f64> {
            versions
                .range(..=v)
                .next_back()
                .map(|(_, x)| *x)
                .or_else(|| (v == 0).then_some(0.0))
        };
        let (mut train, mut sps) = (Grouped::default(), Grouped::default());
        for line in &metrics {
            let values = &line["values"];
            let get = |name: &str| finite(&values[name]);
            let instance = line["instance"].as_str().unwrap_or("?");
            if let Some(s) = get("learner_sps") {
                if let Some(x) = get("learner_vec_steps").or_else(|| finite(&line["vec_steps"])) {
                    sps.push("learner_sps", (x, s));
                }
            }
            // An env-runner's values sit at the version it acted with.
            let x = match get("env_runner_policy_version") {
                Some(v) => at_version(v as u64),
                None => finite(&line["vec_steps"]),
            };
            let Some(x) = x else { continue };
            if let Some(r) = get("env_runner_episode_return_mean") {
                train.push(instance, (x, r));
            }
            if let Some(s) = get("env_runner_sps") {
                sps.push(&format!("env_runner_sps ({instance})"), (x, s));
            }
        }

        curves.train_return = train.into_series();
        if curves.train_return.len() == 1 {
            curves.train_return[0].label = "train (mean of last 100 episodes)".into();
        } else {
            for s in &mut curves.train_return {
                s.label = format!("train {}", s.label);
            }
        }
        // Fewer than two env-runner means in metrics.jsonl (a run shorter
        // than their report period draws no line from them): the run's
        // rolling mean from episodes.jsonl, one point per batch of episodes.
        if curves
            .train_return
            .iter()
            .map(|s| s.points.len())
            .sum::<usize>()
            < 2
        {
            let mut recent = std::collections::VecDeque::with_capacity(100);
            let mut points = Vec::new();
            for batch in jsonl(&run_dir.join("episodes.jsonl")) {
                let returns = batch["episodes"].as_array().cloned().unwrap_or_default();
                for r in returns.iter().filter_map(|e| finite(&e["return"])) {
                    if recent.len() == 100 {
                        recent.pop_front();
                    }
                    recent.push_back(r);
                }
                let x = batch["policy_version"].as_u64().and_then(at_version);
                if let (Some(x), false) = (x, recent.is_empty()) {
                    points.push((x, recent.iter().sum::<f64>() / recent.len() as f64));
                }
            }
            if !points.is_empty() {
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                curves.train_return.clear();
                curves.train_return.push(Series {
                    label: "train (rolling mean of 100 episodes)".into(),
                    points,
                });
            }
        }

        let mut evals: Vec<(String, Vec<EvalPoint>)> = Vec::new();
        for e in jsonl(&run_dir.join("eval.jsonl")) {
            let (Some(mean), Some(version)) =
                (finite(&e["mean_return"]), e["policy_version"].as_u64())
            else {
                continue;
            };
            let x = at_version(version)
                .or_else(|| Some(finite(&e["learner_env_steps"])? * vec_per_env?));
            let Some(x) = x else { continue };
            if let Some(t) = finite(&e["threshold"]) {
                curves.threshold = Some(t);
            }
            let name = e["evaluator"].as_str().unwrap_or("eval").to_string();
            let point = EvalPoint {
                x,
                mean,
                std: finite(&e["std_return"]).unwrap_or(0.0),
            };
            match evals.iter_mut().find(|(n, _)| *n == name) {
                Some((_, points)) => points.push(point),
                None => evals.push((name, vec![point])),
            }
        }
        for (_, points) in &mut evals {
            points.sort_by(|a, b| a.x.total_cmp(&b.x));
        }
        curves.eval_return = evals;
        for s in [
            &mut curves.policy_loss,
            &mut curves.value_loss,
            &mut curves.entropy,
        ] {
            s.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        curves.sps = sps.into_series();
        curves
    }
}

/// Draws `return.png`, `losses.png` and `sps.png` into `<run_dir>/plots/`
/// and returns their paths. A plot without data says so on its canvas.
pub fn draw_run(run_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    if !run_dir.is_dir() {
        return Err(PlotError(format!(
            "{} is not a run directory",
            run_dir.display()
        )));
    }
    draw(&Curves::load(run_dir), &run_dir.join("plots"))
}

/// Draws the three plots of `curves` into `out_dir`.
pub fn draw(curves: &Curves, out_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    register_fonts()?;
    std::fs::create_dir_all(out_dir).map_err(|e| err(out_dir.display())(&e))?;
    let mut written = Vec::new();
    let plots: [(&str, (u32, u32), &DrawFn); 3] = [
        ("return", (1000, 600), &|area| draw_return(curves, area)),
        ("losses", (1000, 900), &|area| draw_losses(curves, area)),
        ("sps", (1000, 600), &|area| draw_sps(curves, area)),
    ];
    for (name, size, draw) in plots {
        let path = out_dir.join(format!("{name}.png"));
        // The backend picks the format by extension: the temporary name keeps `.png`.
        let tmp = out_dir.join(format!(".{name}.tmp.png"));
        {
            let area = BitMapBackend::new(&tmp, size).into_drawing_area();
            area.fill(&WHITE).map_err(|e| err(name)(&e))?;
            draw(&area)?;
            area.present().map_err(|e| err(tmp.display())(&e))?;
        }
        std::fs::rename(&tmp, &path).map_err(|e| err(path.display())(&e))?;
        written.push(path);
    }
    Ok(written)
}

/// Draws a run's plots, logging (not returning) a failure: for the tracker's shutdown.
pub fn draw_run_logged(run_dir: &Path) {
    match draw_run(run_dir) {
        Ok(paths) => {
            tracing::info!(plots = %run_dir.join("plots").display(), count = paths.len(), "drew learning curves")
        }
        Err(e) => tracing::error!(error = %e, "cannot draw the learning curves"),
    }
}

/// One curve of [`draw_compared`]: its label and, per point, `(x, y,
/// band low, band high)`.
pub type ComparedCurve = (String, Vec<(f64, f64, f64, f64)>);

/// Learning curves of several trainers on one chart, each with its band
/// shaded (`relay bench-parity`: relay and its anchor, the mean over seeds
/// and its bootstrap interval, against env steps), written to `path` (a
/// `.png`).
pub fn draw_compared(
    path: &Path,
    title: &str,
    x_desc: &str,
    curves: &[ComparedCurve],
) -> Result<(), PlotError> {
    register_fonts()?;
    let points: Vec<Vec<(f64, f64)>> = curves
        .iter()
        .map(|(_, c)| c.iter().map(|p| (p.0, p.1)).collect())
        .collect();
    let lines: Vec<Line> = curves
        .iter()
        .zip(&points)
        .enumerate()
        .map(|(i, ((label, _), points))| Line {
            label: label.clone(),
            points,
            color: COLORS[i % COLORS.len()],
            markers: true,
        })
        .collect();
    let extras: Vec<Extra> = curves
        .iter()
        .enumerate()
        .map(|(i, (_, c))| {
            Extra::Band(
                c.iter().map(|p| (p.0, p.2, p.3)).collect(),
                COLORS[i % COLORS.len()],
            )
        })
        .collect();
    let area = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    area.fill(&WHITE).map_err(|e| err(title)(&e))?;
    panel(
        &area,
        title,
        x_desc,
        "episode return",
        &lines,
        &extras,
        false,
    )?;
    area.present().map_err(|e| err(path.display())(&e))
}

fn register_fonts() -> Result<(), PlotError> {
    static FONTS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *FONTS.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_ok()
            && plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold())
                .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(PlotError(
            "the embedded DejaVu Sans font did not load".into(),
        ))
    }
}

/// The x axis of a run's plots (module docs).
const X_DESC: &str = "vec_steps";

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type DrawFn<'a> = dyn Fn(&Area) -> Result<(), PlotError> + 'a;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// A curve to draw.
struct Line<'a> {
    label: String,
    points: &'a [(f64, f64)],
    color: RGBColor,
    markers: bool,
}

/// An extra on a panel: a ±std band around a curve, or a horizontal line.
enum Extra {
    Band(Vec<(f64, f64, f64)>, RGBColor),
    Horizontal(f64, String),
}

/// A number as a short label: `12.5k`, `1.5M`, `0.65`, `-0.005`.
fn human(v: f64) -> String {
    tick(v, v.abs())
}

/// A tick label on an axis spanning `span`: as many decimals as the span
/// needs, thousands as `k` and millions as `M`, and `0` for the float noise
/// of a tick at zero.
fn tick(v: f64, span: f64) -> String {
    fn trim(s: String) -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    }
    let span = if span.is_finite() && span > 0.0 {
        span
    } else {
        v.abs().max(1.0)
    };
    let a = v.abs();
    if a < span * 1e-9 {
        "0".into()
    } else if a >= 1e6 {
        format!("{}M", trim(format!("{:.2}", v / 1e6)))
    } else if a >= 1e3 && span >= 1e2 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else {
        let decimals = ((-span.log10()).ceil() + 1.0).clamp(0.0, 9.0) as usize;
        trim(format!("{v:.decimals$}"))
    }
}

/// The legend corner that hides the fewest points.
fn legend_corner(lines: &[Line], x: (f64, f64), y: (f64, f64)) -> SeriesLabelPosition {
    let corners = [
        (SeriesLabelPosition::LowerRight, 1.0, 0.0),
        (SeriesLabelPosition::UpperRight, 1.0, 1.0),
        (SeriesLabelPosition::LowerLeft, 0.0, 0.0),
        (SeriesLabelPosition::UpperLeft, 0.0, 1.0),
    ];
    let hidden = |cx: f64, cy: f64| {
        lines
            .iter()
            .flat_map(|l| l.points.iter())
            .filter(|p| {
                let fx = (p.0 - x.0) / (x.1 - x.0);
                let fy = (p.1 - y.0) / (y.1 - y.0);
                (fx - cx).abs() < 0.35 && (fy - cy).abs() < 0.3
            })
            .count()
    };
    corners
        .into_iter()
        .min_by_key(|(_, cx, cy)| hidden(*cx, *cy))
        .map(|(corner, _, _)| corner)
        .expect("four corners")
}

/// The padded range of the finite values. With `trim` and at least 10
/// values, a few extreme ones (2% on each side, at least one, when beyond
/// twice the spread of the others) are left outside the range, so a
/// start-up spike (the learner's first SPS) does not flatten the curves.
fn range(values: impl Iterator<Item = f64>, pad: f64, trim: bool) -> Option<(f64, f64)> {
    let mut v: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let (mut lo, mut hi) = (v[0], v[n - 1]);
    if trim && n >= 10 {
        let k = (n / 50).max(1);
        let (a, b) = (v[k], v[n - 1 - k]);
        let spread = b - a;
        if hi > b + 2.0 * spread {
            hi = b + 0.25 * spread;
        }
        if lo < a - 2.0 * spread {
            lo = a - 0.25 * spread;
        }
    }
    let span = if hi > lo { hi - lo } else { lo.abs().max(1.0) };
    Some((lo - span * pad, hi + span * pad))
}

/// Most points a curve is drawn with: about two per pixel column of the
/// widest plot. A run of hours has tens of thousands of points a curve,
/// whose rasterizing took seconds, and the tracker draws the plots as it
/// stops, within the promise of every service (2 s).
const MAX_POINTS: usize = 2000;

/// `points` thinned to at most `max` (`max` at least 4): consecutive
/// chunks each keep their lowest and highest point, in the order they
/// came, so the drawn line spans the same values; the first and the last
/// point stay.
fn thin(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max {
        return points.to_vec();
    }
    let chunk = points.len().div_ceil(max / 2 - 1);
    let mut out = Vec::with_capacity(max);
    out.push(points[0]);
    for part in points[1..points.len() - 1].chunks(chunk) {
        let low = part
            .iter()
            .enumerate()
            .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1));
        let high = part
            .iter()
            .enumerate()
            .max_by(|a, b| a.1 .1.total_cmp(&b.1 .1));
        let (Some((i, lo)), Some((j, hi))) = (low, high) else {
            continue;
        };
        match i.cmp(&j) {
            std::cmp::Ordering::Less => out.extend([*lo, *hi]),
            std::cmp::Ordering::Greater => out.extend([*hi, *lo]),
            std::cmp::Ordering::Equal => out.push(*lo),
        }
    }
    out.push(points[points.len() - 1]);
    out
}

/// A band's `(x, low, high)` points thinned to at most `max`: each chunk
/// one point at its first x, spanning its lowest low and highest high.
fn thin_band(band: &[(f64, f64, f64)], max: usize) -> Vec<(f64, f64, f64)> {
    if band.len() <= max {
        return band.to_vec();
    }
    band.chunks(band.len().div_ceil(max))
        .map(|part| {
            let low = part.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
            let high = part.iter().map(|p| p.2).fold(f64::NEG_INFINITY, f64::max);
            (part[0].0, low, high)
        })
        .collect()
}

fn panel(
    area: &Area,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    lines: &[Line],
    extras: &[Extra],
    trim_outliers: bool,
) -> Result<(), PlotError> {
    let xs = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .chain(extras.iter().flat_map(|e| match e {
            Extra::Band(b, _) => b.iter().map(|p| p.0).collect::<Vec<_>>(),
            Extra::Horizontal(..) => Vec::new(),
        }));
    let ys = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .chain(extras.iter().flat_map(|e| match e {
            Extra::Band(b, _) => b.iter().flat_map(|p| [p.1, p.2]).collect::<Vec<_>>(),
            Extra::Horizontal(y, _) => vec![*y],
        }));
    let (Some(mut x), Some(y)) = (range(xs, 0.0, false), range(ys, 0.05, trim_outliers)) else {
        let (w, h) = area.dim_in_pixel();
        area.draw(&Text::new(
            title.to_string(),
            (20, 15),
            ("sans-serif", 24).into_font(),
        ))
        .map_err(|e| err(title)(&e))?;
        area.draw(&Text::new(
            "no data yet".to_string(),
            (w as i32 / 2 - 60, h as i32 / 2),
            ("sans-serif", 22)
                .into_font()
                .color(&RGBColor(120, 120, 120)),
        ))
        .map_err(|e| err(title)(&e))?;
        return Ok(());
    };
    if x.0 == x.1 {
        x = (x.0 - 0.5, x.1 + 0.5);
    }
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(x.0..x.1, y.0..y.1)
        .map_err(|e| err(title)(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|v| tick(*v, x.1 - x.0))
        .y_label_formatter(&|v| tick(*v, y.1 - y.0))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| err(title)(&e))?;
    for extra in extras {
        match extra {
            Extra::Band(band, color) if !band.is_empty() => {
                let band = thin_band(band, MAX_POINTS / 2);
                let outline: Vec<(f64, f64)> = band
                    .iter()
                    .map(|p| (p.0, p.2))
                    .chain(band.iter().rev().map(|p| (p.0, p.1)))
                    .collect();
                chart
                    .draw_series(std::iter::once(Polygon::new(outline, color.mix(0.18))))
                    .map_err(|e| err(title)(&e))?;
            }
            Extra::Band(..) => {}
            Extra::Horizontal(yv, label) => {
                let grey = RGBColor(110, 110, 110);
                chart
                    .draw_series(LineSeries::new(
                        [(x.0, *yv), (x.1, *yv)],
                        grey.stroke_width(1),
                    ))
                    .map_err(|e| err(title)(&e))?
                    .label(label.clone())
                    .legend(move |(lx, ly)| PathElement::new([(lx, ly), (lx + 20, ly)], grey));
            }
        }
    }
    for line in lines {
        let color = line.color;
        let points = thin(line.points, MAX_POINTS);
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(title)(&e))?
            .label(line.label.clone())
            .legend(move |(lx, ly)| {
                PathElement::new([(lx, ly), (lx + 20, ly)], color.stroke_width(2))
            });
        // A single point draws no line: mark it.
        if line.markers || line.points.len() < 2 {
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(|e| err(title)(&e))?;
        }
    }
    chart
        .configure_series_labels()
        .position(legend_corner(lines, x, y))
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .draw()
        .map_err(|e| err(title)(&e))?;
    Ok(())
}

fn draw_return(curves: &Curves, area: &Area) -> Result<(), PlotError> {
    let eval_points: Vec<(String, Vec<(f64, f64)>)> = curves
        .eval_return
        .iter()
        .map(|(name, points)| (name.clone(), points.iter().map(|p| (p.x, p.mean)).collect()))
        .collect();
    let mut lines: Vec<Line> = curves
        .train_return
        .iter()
        .enumerate()
        .map(|(i, s)| Line {
            label: s.label.clone(),
            points: &s.points,
            color: COLORS[i * 2 % COLORS.len()],
            markers: false,
        })
        .collect();
    let mut extras = Vec::new();
    for (i, (name, points)) in eval_points.iter().enumerate() {
        let color = COLORS[(i * 2 + 1) % COLORS.len()];
        lines.push(Line {
            label: if eval_points.len() == 1 {
                "eval mean (± std)".into()
            } else {
                format!("eval {name} (± std)")
            },
            points,
            color,
            markers: true,
        });
        let band = curves.eval_return[i]
            .1
            .iter()
            .map(|p| (p.x, p.mean - p.std, p.mean + p.std))
            .collect();
        extras.push(Extra::Band(band, color));
    }
    if let Some(t) = curves.threshold {
        extras.push(Extra::Horizontal(t, format!("solved at {}", human(t))));
    }
    panel(
        area,
        "Return",
        X_DESC,
        "episode return",
        &lines,
        &extras,
        false,
    )
}

fn draw_losses(curves: &Curves, area: &Area) -> Result<(), PlotError> {
    let panels = area.split_evenly((3, 1));
    for (i, (title, points)) in [
        ("Policy loss", &curves.policy_loss),
        ("Value loss", &curves.value_loss),
        ("Entropy", &curves.entropy),
    ]
    .into_iter()
    .enumerate()
    {
        let name = [
            "learner_policy_loss",
            "learner_value_loss",
            "learner_entropy",
        ][i];
        let line = Line {
            label: name.into(),
            points,
            color: COLORS[i],
            markers: false,
        };
        panel(
            &panels[i],
            title,
            X_DESC,
            title.to_ascii_lowercase().as_str(),
            &[line],
            &[],
            false,
        )?;
    }
    Ok(())
}

fn draw_sps(curves: &Curves, area: &Area) -> Result<(), PlotError> {
    let lines: Vec<Line> = curves
        .sps
        .iter()
        .enumerate()
        .map(|(i, s)| Line {
            label: s.label.clone(),
            points: &s.points,
            color: COLORS[i % COLORS.len()],
            markers: false,
        })
        .collect();
    panel(
        area,
        "Throughput",
        X_DESC,
        "env steps per second",
        &lines,
        &[],
        true,
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_curves_are_thinned_to_their_extremes() {
        let points: Vec<(f64, f64)> = (0..100_000)
            .map(|i| {
                (
                    i as f64,
                    ((i * 7919) % 1000) as f64 - if i == 64_321 { 5000.0 } else { 0.0 },
                )
            })
            .collect();
        let thinned = super::thin(&points, 2000);
        assert!(thinned.len() <= 2000, "{}", thinned.len());
        assert_eq!(thinned.first(), points.first());
        assert_eq!(thinned.last(), points.last());
        // The extremes stay, and the order of x.
        assert!(thinned.contains(&(64_321.0, (64_321 * 7919 % 1000) as f64 - 5000.0)));
        assert!(thinned.iter().any(|p| p.1 == 999.0));
        assert!(thinned.windows(2).all(|w| w[0].0 < w[1].0));
        // Short curves are drawn as they are.
        assert_eq!(super::thin(&points[..1500], 2000), points[..1500]);
        let band: Vec<(f64, f64, f64)> = (0..10_000)
            .map(|i| (i as f64, -(i as f64), i as f64))
            .collect();
        let thinned = super::thin_band(&band, 1000);
        assert!(thinned.len() <= 1000);
        assert_eq!(thinned.last().unwrap().2, 9999.0);
        assert_eq!(thinned.iter().map(|p| p.1).fold(0.0, f64::min), -9999.0);
    }

    use super::*;

    #[test]
    fn ranges_pad_and_optionally_leave_out_a_spike() {
        assert_eq!(range([1.0, 3.0].into_iter(), 0.5, false), Some((0.0, 4.0)));
        assert_eq!(range([f64::NAN].into_iter(), 0.0, false), None);
        assert_eq!(range([2.0].into_iter(), 0.0, false), Some((2.0, 2.0)));
        let spiky: Vec<f64> = std::iter::once(250_000.0)
            .chain((0..99).map(|i| 2000.0 + i as f64))
            .collect();
        assert_eq!(
            range(spiky.iter().copied(), 0.0, false).unwrap().1,
            250_000.0
        );
        let (lo, hi) = range(spiky.iter().copied(), 0.0, true).unwrap();
        assert!(lo == 2000.0 && hi < 2200.0, "{lo} {hi}");
    }

    #[test]
    fn a_run_shorter_than_a_report_period_still_has_a_training_curve() {
        let dir = std::env::temp_dir().join(format!("relay-plots-short-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // The learner's versions, one env-runner report, three batches of episodes.
        std::fs::write(
            dir.join("metrics.jsonl"),
            [
                r#"{"service":"learner","instance":"l","vec_steps":256,"values":{"learner_policy_version":1,"learner_vec_steps":256}}"#,
                r#"{"service":"learner","instance":"l","vec_steps":512,"values":{"learner_policy_version":2,"learner_vec_steps":512}}"#,
                r#"{"service":"env-runner","instance":"e","vec_steps":500,"values":{"env_runner_policy_version":2,"env_runner_episode_return_mean":30.0}}"#,
            ]
            .join("\n"),
        )
        .unwrap();
        std::fs::write(
            dir.join("episodes.jsonl"),
            [
                r#"{"policy_version":0,"episodes":[{"return":10.0}]}"#,
                r#"{"policy_version":1,"episodes":[{"return":20.0}]}"#,
                r#"{"policy_version":2,"episodes":[{"return":60.0}]}"#,
            ]
            .join("\n"),
        )
        .unwrap();
        let curves = Curves::load(&dir);
        assert_eq!(curves.train_return.len(), 1);
        let points = &curves.train_return[0].points;
        assert!(points.len() >= 2, "{points:?}");
        assert_eq!(points.last().unwrap().1, 30.0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(human(0.0), "0");
        assert_eq!(human(2000.0), "2k");
        assert_eq!(human(12_500.0), "12.5k");
        assert_eq!(human(1_500_000.0), "1.5M");
        assert_eq!(human(0.65), "0.65");
        assert_eq!(human(-0.005), "-0.005");
        assert_eq!(human(475.0), "475");
        // Ticks follow the axis span; float noise at zero is 0.
        assert_eq!(tick(3.5e-18, 0.08), "0");
        assert_eq!(tick(-0.01, 0.08), "-0.01");
        assert_eq!(tick(0.68, 0.2), "0.68");
        assert_eq!(tick(25.0, 25.0), "25");
        assert_eq!(tick(1500.0, 3000.0), "1.5k");
    }
}
