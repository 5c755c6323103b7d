//! `neuraldbg watch`: follows a trace while the run writes it.
//!
//! [`Follow`] reads whatever the writer appended since the last look and feeds it to an engine,
//! exactly as replay does, so the live view says what `explain` will say. Two faces: a terminal
//! UI (ratatui) when standard output is a terminal, and plain lines (one per confirmed event,
//! the verdict at the end) for logs and job schedulers.

use std::collections::VecDeque;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use neuraldbg_core::analysis::explain;
use neuraldbg_core::report::{HealthStrip, health_strip};
use neuraldbg_core::trace::{
    Damage, MAGIC, PREAMBLE_LEN, Record, TraceError, TraceHeader, TraceReader,
};
use neuraldbg_core::{Engine, GradientHealth, SemanticEvent};
use serde_json::Value;

use crate::{Io, Stop, text};

/// Longest a single look at the file reads before the view is refreshed (a long trace opened
/// mid-run is caught up over several looks, with the view showing progress).
const READ_BUDGET: Duration = Duration::from_millis(150);
/// Window of the steps/s estimate.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// What is known about the process writing the trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Writer {
    /// The trace header names no process on this machine (another host, or an older writer).
    Unknown,
    Alive(u64),
    /// The process that wrote the trace no longer runs, and the trace was not closed.
    Gone(u64),
}

/// A trace being followed.
pub struct Follow {
    path: PathBuf,
    reader: Option<TraceReader<BufReader<File>>>,
    pub header: Option<TraceHeader>,
    pub engine: Option<Engine>,
    pub steps: u64,
    pub closed: bool,
    /// Damage that ends the trace for good (a checksum mismatch, a malformed or refused record).
    pub damage: Option<Damage>,
    pub writer: Writer,
    /// When the file last grew, and when its size was last seen.
    pub last_growth: Instant,
    len: u64,
    /// Whether the last look reached the end of what was written.
    pub caught_up: bool,
    /// `(when, steps)` samples taken while caught up, for the rate.
    samples: VecDeque<(Instant, u64)>,
    /// The trace was replaced by a new run while followed.
    pub restarted: u32,
}

impl std::fmt::Debug for Follow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Follow")
            .field("path", &self.path)
            .field("steps", &self.steps)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

/// The name of this machine, to tell whether the writer's process id is ours to check.
fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|h| !h.is_empty())
}

/// Whether process `pid` runs (a zombie, killed but not yet reaped, does not), when this
/// machine can tell (Linux's /proc).
fn process_alive(pid: u64) -> Option<bool> {
    if !Path::new("/proc/self").exists() {
        return None;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Some(false);
    };
    // `pid (comm) S ...`: the state follows the last parenthesis (comm may hold any byte).
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    Some(!matches!(state, Some('Z' | 'X')))
}

impl Follow {
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            reader: None,
            header: None,
            engine: None,
            steps: 0,
            closed: false,
            damage: None,
            writer: Writer::Unknown,
            last_growth: Instant::now(),
            len: 0,
            caught_up: false,
            samples: VecDeque::new(),
            restarted: 0,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether nothing more will come: closed, damaged, or its writer is gone.
    pub fn finished(&self) -> bool {
        self.closed || self.damage.is_some() || matches!(self.writer, Writer::Gone(_))
    }

    /// Steps per second over the last seconds, once caught up with the writer.
    pub fn rate(&self) -> Option<f64> {
        let (t0, s0) = *self.samples.front()?;
        let (t1, s1) = *self.samples.back()?;
        let dt = t1.duration_since(t0).as_secs_f64();
        (dt >= 1.0).then(|| (s1 - s0) as f64 / dt)
    }

    /// Seconds since the file last grew.
    pub fn idle(&self) -> Duration {
        self.last_growth.elapsed()
    }

    fn reset(&mut self) {
        let restarted = self.restarted + 1;
        *self = Self::new(&self.path);
        self.restarted = restarted;
    }

    /// Reads what was appended since the last look. Returns the events confirmed by the new
    /// steps, in the order they were confirmed. Fails only when the file is not a trace this
    /// build can read.
    pub fn poll(&mut self) -> Result<Vec<SemanticEvent>, Stop> {
        let len = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if len != self.len {
            self.last_growth = Instant::now();
        }
        if len < self.len && self.reader.is_some() {
            // Shorter than what was read: a new run replaced the file.
            self.reset();
        }
        self.len = len;
        if self.reader.is_none() {
            if len < PREAMBLE_LEN as u64 {
                // A short file that does not begin like a trace never becomes one.
                if len > 0 && !starts_like_trace(&self.path) {
                    return Err(TraceError::NotATrace {
                        origin: self.path.display().to_string(),
                    }
                    .into());
                }
                return Ok(Vec::new());
            }
            self.reader = Some(TraceReader::open(&self.path).map_err(Stop::from)?);
        }
        let before = self.engine.as_ref().and_then(Engine::last_step);
        let start = Instant::now();
        self.caught_up = false;
        while let Some(reader) = self.reader.as_mut() {
            let Some(record) = reader.next_record() else {
                if reader.closed() {
                    self.closed = true;
                } else if !reader.resume().map_err(Stop::from)? {
                    self.damage = reader.damage().cloned();
                }
                self.caught_up = true;
                break;
            };
            match record {
                Record::Header(h) => {
                    let bad = |e: neuraldbg_core::EngineError| {
                        Stop::from(TraceError::BadHeader {
                            origin: self.path.display().to_string(),
                            message: e.to_string(),
                        })
                    };
                    let mut engine = Engine::new(h.config.clone()).map_err(bad)?;
                    engine.register_model(h.model.clone()).map_err(bad)?;
                    self.writer = writer_of(&h);
                    self.engine = Some(engine);
                    self.header = Some(*h);
                }
                Record::Step(obs) => {
                    let Some(engine) = self.engine.as_mut() else {
                        break;
                    };
                    if let Err(e) = engine.observe(&obs.view()) {
                        reader.reject_last(e.to_string());
                        self.damage = reader.damage().cloned();
                        break;
                    }
                    self.steps += 1;
                }
                Record::ParamLr(lrs) => {
                    let Some(engine) = self.engine.as_mut() else {
                        break;
                    };
                    if let Err(e) = engine.amend_param_lr(lrs.as_deref()) {
                        reader.reject_last(e.to_string());
                        self.damage = reader.damage().cloned();
                        break;
                    }
                }
                Record::FirstBatch(facts) => {
                    let Some(engine) = self.engine.as_mut() else {
                        break;
                    };
                    if let Err(e) = engine.amend_first_batch(&facts) {
                        reader.reject_last(e.to_string());
                        self.damage = reader.damage().cloned();
                        break;
                    }
                }
                Record::End { .. } | Record::Unobserved(_) | Record::Clock(_) => {}
            }
            if start.elapsed() > READ_BUDGET {
                break;
            }
        }
        if let Writer::Alive(pid) = self.writer {
            if !self.closed && process_alive(pid) == Some(false) {
                self.writer = Writer::Gone(pid);
                // Read once more: the writer may have appended its last steps between this
                // look's end of file and its death.
                self.caught_up = false;
            }
        }
        if self.caught_up {
            let now = Instant::now();
            self.samples.push_back((now, self.steps));
            while self
                .samples
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
            {
                self.samples.pop_front();
            }
        }
        let Some(engine) = &self.engine else {
            return Ok(Vec::new());
        };
        if before.is_some() && engine.last_step() == before {
            return Ok(Vec::new()); // no step read: no new event (an idle poll copies nothing)
        }
        let mut new: Vec<SemanticEvent> = engine
            .events()
            .into_iter()
            .filter(|e| before.is_none_or(|b| e.confirmed_step > b))
            .collect();
        new.sort_by_key(|e| (e.confirmed_step, e.step));
        Ok(new)
    }

    /// A one-line status: what the view is showing and whether more will come.
    pub fn status(&self) -> String {
        if self.reader.is_none() {
            return format!("waiting for {} to be created", self.path.display());
        }
        if self.engine.is_none() {
            return "waiting for the first training step (the model header)".into();
        }
        if let Some(d) = &self.damage {
            return format!("damaged at {d}; showing the steps before it");
        }
        if self.closed {
            return "closed: the run ended".into();
        }
        if let Writer::Gone(pid) = self.writer {
            return format!(
                "the writer (process {pid}) stopped without closing the trace: it was killed or crashed"
            );
        }
        if !self.caught_up {
            return "catching up with the trace...".into();
        }
        let idle = self.idle().as_secs();
        let who = match self.writer {
            Writer::Alive(pid) => format!("writer process {pid} running"),
            _ => "writer on another machine or unknown".into(),
        };
        if idle >= 10 {
            format!("following ({who}); no new step for {idle}s")
        } else {
            format!("following ({who})")
        }
    }
}

/// Whether the first bytes of `path` are (a prefix of) the trace magic.
fn starts_like_trace(path: &Path) -> bool {
    use std::io::Read as _;
    let mut head = Vec::with_capacity(MAGIC.len());
    let read =
        std::fs::File::open(path).and_then(|f| f.take(MAGIC.len() as u64).read_to_end(&mut head));
    read.is_err() || MAGIC.starts_with(&head)
}

/// The writer's process, when the trace header names one on this machine.
pub(crate) fn writer_of(h: &TraceHeader) -> Writer {
    let pid = h.meta.get("pid").and_then(Value::as_u64);
    let host = h.meta.get("host").and_then(Value::as_str);
    match (pid, host, hostname()) {
        (Some(pid), Some(host), Some(here)) if host == here => match process_alive(pid) {
            Some(true) => Writer::Alive(pid),
            Some(false) => Writer::Gone(pid),
            None => Writer::Unknown,
        },
        _ => Writer::Unknown,
    }
}

/// The verdict as the `explain` command prints it.
fn verdict_lines(follow: &Follow) -> Vec<String> {
    let Some(engine) = &follow.engine else {
        return vec!["neuraldbg: no training step was written: nothing to judge".into()];
    };
    let hypotheses = explain(engine, None);
    if hypotheses.is_empty() {
        return vec![format!(
            "neuraldbg: no failure found in {} steps",
            follow.steps
        )];
    }
    hypotheses.iter().map(text::hypothesis_line).collect()
}

/// Plain mode: one line per confirmed event as it is confirmed, then the verdict.
pub fn plain(path: &Path, interval: Duration, io: &mut Io<'_>) -> Result<Follow, Stop> {
    let mut follow = Follow::new(path);
    let mut announced = false;
    let mut said_waiting = false;
    loop {
        let new = follow.poll()?;
        if !announced {
            if let (Some(h), Some(engine)) = (&follow.header, &follow.engine) {
                let layers = engine.model().map_or(0, |m| m.layers.len());
                let model = h
                    .meta
                    .get("model")
                    .and_then(Value::as_str)
                    .unwrap_or("model");
                io.note(&format!(
                    "neuraldbg: watching {} ({model}, {layers} layers)",
                    path.display()
                ));
                announced = true;
            } else if !said_waiting {
                io.note(&format!("neuraldbg: {}", follow.status()));
                said_waiting = true;
            }
        }
        if let Some(engine) = &follow.engine {
            for e in &new {
                io.print(&text::event_line(engine, e))?;
            }
        }
        if follow.finished() && follow.caught_up {
            break;
        }
        if follow.caught_up {
            std::thread::sleep(interval);
        }
    }
    if !follow.closed {
        io.note(&format!("neuraldbg: {}", follow.status()));
    }
    for line in verdict_lines(&follow) {
        io.print(&line)?;
    }
    Ok(follow)
}

// ------------------------------------------------------------------ terminal UI

mod tui {
    use super::{Follow, GradientHealth, HealthStrip, health_strip};
    use neuraldbg_core::analysis::explain;
    use neuraldbg_core::{CausalHypothesis, display_name};
    use ratatui::Frame;
    use ratatui::layout::{Constraint, Layout, Rect};
    use ratatui::style::{Color, Modifier, Style};
    use ratatui::text::{Line, Span};
    use ratatui::widgets::{Block, Paragraph};

    /// Widest the layer names in the strip get (longer ones keep their end: `…layer.11.mlp`).
    const NAME_WIDTH: usize = 24;

    /// Width of the name column: the longest name, within bounds.
    pub fn name_width(follow: &Follow) -> usize {
        follow
            .engine
            .as_ref()
            .and_then(|e| e.model())
            .map_or(4, |m| {
                m.layers
                    .iter()
                    .map(|l| display_name(&l.name).chars().count())
                    .max()
                    .unwrap_or(4)
            })
            .clamp(4, NAME_WIDTH)
    }

    pub fn colour(h: GradientHealth) -> Color {
        match h {
            GradientHealth::Healthy => Color::Green,
            GradientHealth::Vanishing => Color::Blue,
            GradientHealth::Saturated => Color::Yellow,
            GradientHealth::Exploding => Color::Red,
            GradientHealth::NonFinite => Color::Magenta,
        }
    }

    fn glyph(h: Option<GradientHealth>) -> Span<'static> {
        match h {
            None => Span::styled("·", Style::new().fg(Color::DarkGray)),
            Some(GradientHealth::NonFinite) => Span::styled(
                "!",
                Style::new().fg(Color::Magenta).add_modifier(Modifier::BOLD),
            ),
            Some(h) => Span::styled("█", Style::new().fg(colour(h))),
        }
    }

    fn shorten(name: &str, width: usize) -> String {
        let n = name.chars().count();
        if n <= width {
            format!("{name:<width$}")
        } else {
            let tail: String = name.chars().skip(n - (width - 1)).collect();
            format!("…{tail}")
        }
    }

    /// What a frame shows, computed when new steps arrive (not at every redraw).
    #[derive(Default)]
    pub struct View {
        pub strip: Option<HealthStrip>,
        pub hypotheses: Vec<CausalHypothesis>,
        pub events: Vec<String>,
        pub events_total: usize,
        /// Width of the layer-name column.
        pub names: usize,
    }

    impl View {
        pub fn refresh(&mut self, follow: &Follow, columns: usize) {
            let Some(engine) = &follow.engine else {
                return;
            };
            self.strip = health_strip(engine, columns);
            self.hypotheses = explain(engine, None);
            let events = engine.events();
            self.events_total = events.len();
            self.events = events
                .iter()
                .rev()
                .take(64)
                .rev()
                .map(|e| crate::text::event_line(engine, e))
                .collect();
        }

        pub fn columns_for(area_width: u16, names: usize) -> usize {
            (area_width as usize).saturating_sub(names + 3).max(1)
        }
    }

    pub fn draw(frame: &mut Frame<'_>, follow: &Follow, view: &View) {
        let area = frame.area();
        let rows = view.strip.as_ref().map_or(1, |s| s.rows.len().max(1)) as u16;
        let hyp_lines = hypothesis_lines(follow, view, area.width.saturating_sub(2));
        // The hypotheses take the lines they fill (the top one wrapped whole), no more.
        let hyps_height = (hyp_lines.len() as u16 + 2).min(8);
        let strip_height = (rows + 2).min(area.height.saturating_sub(8 + hyps_height).max(5));
        let [head, strip, hyps, events, foot] = Layout::vertical([
            Constraint::Length(4),
            Constraint::Length(strip_height),
            Constraint::Length(hyps_height),
            Constraint::Min(3),
            Constraint::Length(1),
        ])
        .areas(area);
        header(frame, head, follow);
        health(frame, strip, view);
        frame.render_widget(
            Paragraph::new(hyp_lines).block(Block::bordered().title(" Top hypotheses ")),
            hyps,
        );
        let title = format!(" Events ({} confirmed, newest last) ", view.events_total);
        let lines: Vec<Line<'_>> = view
            .events
            .iter()
            .rev()
            .take(events.height.saturating_sub(2) as usize)
            .rev()
            .map(|l| Line::raw(l.as_str()))
            .collect();
        frame.render_widget(
            Paragraph::new(lines).block(Block::bordered().title(title)),
            events,
        );
        frame.render_widget(
            Paragraph::new(Line::from(vec![
                Span::styled(" q ", Style::new().add_modifier(Modifier::REVERSED)),
                Span::raw(" quit   "),
                legend_item(GradientHealth::Healthy, "healthy"),
                legend_item(GradientHealth::Saturated, "saturated"),
                legend_item(GradientHealth::Vanishing, "vanishing"),
                legend_item(GradientHealth::Exploding, "exploding"),
                Span::styled(" ! ", Style::new().fg(Color::Magenta)),
                Span::raw("NaN/Inf "),
            ])),
            foot,
        );
    }

    fn legend_item(h: GradientHealth, label: &'static str) -> Span<'static> {
        Span::styled(format!("█ {label}  "), Style::new().fg(colour(h)))
    }

    fn header(frame: &mut Frame<'_>, area: Rect, follow: &Follow) {
        let model = follow
            .header
            .as_ref()
            .and_then(|h| h.meta.get("model"))
            .and_then(|m| m.as_str())
            .unwrap_or("-");
        let layers = follow
            .engine
            .as_ref()
            .and_then(|e| e.model())
            .map_or(0, |m| m.layers.len());
        let step = follow
            .engine
            .as_ref()
            .and_then(neuraldbg_core::Engine::last_step)
            .map_or_else(|| "-".to_string(), |s| s.to_string());
        let rate = follow
            .rate()
            .map_or_else(|| "-".to_string(), |r| format!("{r:.1}"));
        let status_style =
            if follow.damage.is_some() || matches!(follow.writer, super::Writer::Gone(_)) {
                Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)
            } else if follow.closed {
                Style::new().fg(Color::Cyan)
            } else {
                Style::new().fg(Color::Green)
            };
        let lines = vec![
            Line::from(vec![
                Span::styled("step ", Style::new().fg(Color::DarkGray)),
                Span::styled(step, Style::new().add_modifier(Modifier::BOLD)),
                Span::styled("  steps ", Style::new().fg(Color::DarkGray)),
                Span::raw(follow.steps.to_string()),
                Span::styled("  steps/s ", Style::new().fg(Color::DarkGray)),
                Span::raw(rate),
                Span::styled("  model ", Style::new().fg(Color::DarkGray)),
                Span::raw(format!("{model} ({layers} layers)")),
            ]),
            Line::styled(follow.status(), status_style),
        ];
        let title = format!(" neuraldbg watch {} ", follow.path().display());
        frame.render_widget(
            Paragraph::new(lines).block(Block::bordered().title(Span::styled(
                title,
                Style::new().add_modifier(Modifier::BOLD),
            ))),
            area,
        );
    }

    fn health(frame: &mut Frame<'_>, area: Rect, view: &View) {
        let Some(strip) = &view.strip else {
            frame.render_widget(
                Paragraph::new("no step yet").block(Block::bordered().title(" Gradient health ")),
                area,
            );
            return;
        };
        let span = match (strip.columns.first(), strip.columns.last()) {
            (Some(a), Some(b)) => format!("steps {} to {}", a.0, b.1),
            _ => "no step yet".into(),
        };
        let title = format!(" Gradient health per layer, forward order ({span}, newest right) ");
        let visible = area.height.saturating_sub(2) as usize;
        let mut lines: Vec<Line<'_>> = Vec::new();
        let hidden = strip.rows.len().saturating_sub(visible);
        let shown = if hidden > 0 {
            visible.saturating_sub(1)
        } else {
            visible
        };
        for row in strip.rows.iter().take(shown) {
            let mut spans = vec![Span::styled(
                format!("{} ", shorten(display_name(&row.name), view.names)),
                Style::new().fg(Color::Gray),
            )];
            spans.extend(row.cells.iter().map(|c| glyph(*c)));
            lines.push(Line::from(spans));
        }
        if hidden > 0 {
            lines.push(Line::styled(
                format!(
                    "… {} more layers (a taller terminal shows them)",
                    strip.rows.len() - shown
                ),
                Style::new().fg(Color::DarkGray),
            ));
        }
        frame.render_widget(
            Paragraph::new(lines).block(Block::bordered().title(title)),
            area,
        );
    }

    /// The hypotheses box's lines for a box `width` wide: the top failing hypothesis wrapped
    /// whole (up to four lines), the next ones a line each (the terminal cuts them; `explain`
    /// prints them whole).
    fn hypothesis_lines(follow: &Follow, view: &View, width: u16) -> Vec<Line<'static>> {
        let failing: Vec<&CausalHypothesis> = view
            .hypotheses
            .iter()
            .filter(|h| h.confidence >= neuraldbg_core::analysis::FAILURE_CONFIDENCE)
            .take(3)
            .collect();
        if follow.engine.is_none() {
            return vec![Line::raw("waiting for data")];
        }
        let Some((top, rest)) = failing.split_first() else {
            return vec![Line::styled(
                format!(
                    "no failure so far ({} weaker hypotheses)",
                    view.hypotheses.len()
                ),
                Style::new().fg(Color::Green),
            )];
        };
        let bold = Style::new().fg(Color::Red).add_modifier(Modifier::BOLD);
        let mut lines: Vec<Line<'static>> = wrap(&top.to_string(), width.max(20) as usize, 4)
            .into_iter()
            .map(|l| Line::styled(l, bold))
            .collect();
        lines.extend(
            rest.iter()
                .map(|h| Line::styled(h.to_string(), Style::new().fg(Color::Yellow))),
        );
        lines
    }

    /// `text` in lines of at most `width` characters, broken at spaces, at most `max` lines
    /// (the last one ends in `…` when text was left out).
    pub(super) fn wrap(text: &str, width: usize, max: usize) -> Vec<String> {
        let mut lines: Vec<String> = Vec::new();
        let mut line = String::new();
        for word in text.split(' ') {
            let len = line.chars().count();
            if len > 0 && len + 1 + word.chars().count() > width {
                lines.push(std::mem::take(&mut line));
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
        lines.push(line);
        if lines.len() > max {
            lines.truncate(max);
            let last = &mut lines[max - 1];
            let keep: String = last.chars().take(width.saturating_sub(1)).collect();
            *last = format!("{keep}…");
        }
        lines
    }
}

/// The terminal UI, until the trace is closed or the user quits; then the verdict is printed
/// on the normal screen.
pub fn interactive(path: &Path, interval: Duration, io: &mut Io<'_>) -> Result<Follow, Stop> {
    use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};

    let mut follow = Follow::new(path);
    // Fail before taking over the screen when the file is not a trace.
    follow.poll()?;
    let mut terminal = ratatui::try_init()
        .map_err(|e| Stop::new(crate::EXIT_OUTPUT, format!("cannot use the terminal: {e}")))?;
    let mut view = tui::View::default();
    let mut seen: Option<(u64, bool, bool)> = None;
    let mut width = 0;
    let result = (|| -> Result<(), Stop> {
        loop {
            let size = terminal.size().map_err(|e| crate::output_error(&e))?;
            let state = (follow.steps, follow.finished(), follow.caught_up);
            if seen != Some(state) || size.width != width {
                view.names = tui::name_width(&follow);
                view.refresh(&follow, tui::View::columns_for(size.width, view.names));
                seen = Some(state);
                width = size.width;
            }
            terminal
                .draw(|f| tui::draw(f, &follow, &view))
                .map_err(|e| crate::output_error(&e))?;
            if follow.closed && follow.caught_up {
                // Leave the last frame up for a moment so it can be read, then exit.
                std::thread::sleep(Duration::from_millis(300));
                return Ok(());
            }
            let wait = if follow.caught_up {
                interval
            } else {
                Duration::ZERO
            };
            if event::poll(wait).map_err(|e| crate::output_error(&e))? {
                if let Event::Key(k) = event::read().map_err(|e| crate::output_error(&e))? {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if k.kind == KeyEventKind::Press
                        && (ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc))
                    {
                        return Ok(());
                    }
                }
            }
            follow.poll()?;
        }
    })();
    ratatui::restore();
    result?;
    io.note(&format!(
        "neuraldbg: {}: {}",
        path.display(),
        follow.status()
    ));
    for line in verdict_lines(&follow) {
        io.print(&line)?;
    }
    Ok(follow)
}

#[cfg(test)]
mod tests {
    use super::{Follow, tui};
    use neuraldbg_core::trace::{TraceWriter, WriterOptions};
    use neuraldbg_core::{Config, ModelSpec, Observation};
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    #[test]
    fn a_followed_trace_applies_another_optimizers_lrs_where_they_were_recorded() {
        let dir = std::env::temp_dir().join(format!("ndbg-watch-lr-{}", std::process::id()));
        let path = dir.join("split.ndbg");
        let mut spec = ModelSpec::default();
        for i in 0..2 {
            let fc = spec.module(format!("fc{i}"), "Linear");
            spec.param(fc, format!("fc{i}.weight"), &[4, 4]);
        }
        spec.module("", "Net");
        spec.param_lr = Some(vec![Some(0.1), None]);
        let mut w =
            TraceWriter::create(&path, serde_json::Map::new(), WriterOptions::default()).unwrap();
        w.write_header(&Config::default(), &spec).unwrap();
        let obs = |step| Observation {
            step,
            grad_norms: vec![0.1, 0.1],
            ..Observation::default()
        };
        w.write_step(&obs(0).view()).unwrap();
        let mut follow = Follow::new(&path);
        while !follow.caught_up {
            follow.poll().unwrap();
        }
        let lrs = |f: &Follow| {
            f.engine
                .as_ref()
                .unwrap()
                .model()
                .unwrap()
                .spec
                .param_lr
                .clone()
        };
        assert_eq!(lrs(&follow), Some(vec![Some(0.1), None]));
        // The second optimizer's lrs arrive while the follower is reading along.
        w.write_param_lr(Some(&[None, Some(0.01)])).unwrap();
        w.write_step(&obs(1).view()).unwrap();
        w.close().unwrap();
        while !follow.finished() {
            follow.poll().unwrap();
        }
        assert_eq!(follow.steps, 2);
        assert_eq!(lrs(&follow), Some(vec![Some(0.1), Some(0.01)]));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn wrap_breaks_at_spaces_and_marks_what_it_leaves_out() {
        assert_eq!(tui::wrap("aa bb cc", 5, 3), ["aa bb", "cc"]);
        assert_eq!(tui::wrap("aa bb cc dd", 2, 2), ["aa", "b…"]);
    }

    #[test]
    fn an_80x24_terminal_wraps_the_top_hypothesis_and_shows_no_blank_lines() {
        // Twelve layers whose gradients explode from step 5, when the learning rate jumps 1000x:
        // one long top hypothesis with a named cause.
        let dir = std::env::temp_dir().join(format!("ndbg-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("deep.ndbg");
        let mut spec = ModelSpec::default();
        for i in 0..12 {
            let fc = spec.module(format!("encoder.layer.{i}"), "Linear");
            spec.param(fc, format!("encoder.layer.{i}.weight"), &[16, 16]);
        }
        spec.module("", "Net");
        let mut w =
            TraceWriter::create(&path, serde_json::Map::new(), WriterOptions::default()).unwrap();
        w.write_header(&Config::default(), &spec).unwrap();
        for step in 0..30u64 {
            let obs = Observation {
                step,
                grad_norms: (0..12)
                    .map(|l| if step >= 5 && l == 5 { 1e4 } else { 0.05 })
                    .collect(),
                loss: Some(1.0),
                lr: Some(if step >= 5 { 1e-2 } else { 1e-3 }),
                ..Observation::default()
            };
            w.write_step(&obs.view()).unwrap();
        }
        w.close().unwrap();
        let mut follow = Follow::new(&path);
        while !follow.caught_up {
            follow.poll().unwrap();
        }
        let mut view = tui::View {
            names: tui::name_width(&follow),
            ..tui::View::default()
        };
        view.refresh(&follow, tui::View::columns_for(80, view.names));
        let top = view.hypotheses.first().unwrap().to_string();
        assert!(
            top.chars().count() > 80,
            "a hypothesis longer than a line: {top}"
        );
        let mut terminal = Terminal::new(TestBackend::new(80, 24)).unwrap();
        terminal.draw(|f| tui::draw(f, &follow, &view)).unwrap();
        let buffer = terminal.backend().buffer().clone();
        let rows: Vec<String> = (0..24)
            .map(|y| {
                (0..80)
                    .map(|x| buffer[(x, y)].symbol().to_string())
                    .collect()
            })
            .collect();
        let start = rows
            .iter()
            .position(|r| r.contains("Top hypotheses"))
            .unwrap();
        let end = start
            + 1
            + rows[start + 1..]
                .iter()
                .position(|r| r.starts_with('└'))
                .unwrap();
        let inner: Vec<String> = rows[start + 1..end]
            .iter()
            .map(|r| r.trim_matches(|c| c == '│' || c == ' ').to_string())
            .collect();
        assert!(
            inner.iter().all(|l| !l.is_empty()),
            "no blank line: {rows:#?}"
        );
        let shown = inner.join(" ");
        // Wrapped over the panel's lines, not cut to one (what does not fit ends in "…").
        let head: String = top.chars().take(200).collect();
        assert!(
            inner.len() >= 3 && shown.starts_with(&head),
            "the top hypothesis wrapped:\n{shown}\n{top}"
        );
        assert!(rows.iter().any(|r| r.contains("Events")), "{rows:#?}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
