//! The command line: subcommands, arguments and their help.

// Doc comments here are the `--help` text users read, where backticks would show literally.
#![allow(clippy::doc_markdown)]

use std::path::PathBuf;

use clap::builder::PossibleValuesParser;
use clap::{Args, Parser, Subcommand, ValueEnum};
use neuraldbg_core::{ActivationHealth, DataHealth, EventType, GradientHealth, LossHealth};

pub const EXIT_CODES: &str = "\
Exit codes:
  0  success; a damaged trace is used up to the damage, with a warning saying where
  1  the output could not be written
  2  invalid arguments (unknown option, layer, event kind or failure name)
  3  the trace cannot be read: missing file, not a trace, damaged before its first step,
     or no model header (the run ended before its first observed step)
  4  the trace was written by a newer NeuralDBG (upgrade to read it)
  5  with --strict: the trace is damaged (the recovered part is still printed)
  70 internal error (a bug in neuraldbg)";

#[derive(Debug, Parser)]
#[command(
    name = "neuraldbg",
    version,
    about = "Explain why a training run failed, from its NeuralDBG trace",
    long_about = "Explain why a training run failed, from the trace written by \
                  `NeuralDbg(model, trace=\"run.ndbg\")`. The trace is replayed into the engine, \
                  so every answer is exactly what the live run gave.",
    after_help = EXIT_CODES
)]
pub struct Cli {
    /// Exit with code 5 when the trace is damaged (what could be recovered is still printed).
    #[arg(long, global = true)]
    pub strict: bool,
    /// Never show progress (shown on long reads when stderr is a terminal).
    #[arg(long, short, global = true)]
    pub quiet: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// One subcommand each.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Ranked causal hypotheses: what failed, where, from when, why (as `dbg.explain_failure()`)
    Explain(Explain),
    /// The semantic events (confirmed health transitions), in step order
    Events(Events),
    /// Export the diagnosis as JSON, a Mermaid graph, TensorBoard event files or Parquet tables
    Export(Export),
    /// A self-contained HTML report: verdict, gradient-norm heatmap, curves, events, causal graph
    Report(Report),
    /// What a trace holds: model, steps, size, whether it was closed or is damaged
    Info(Info),
    /// Follow a trace while the run writes it: steps/s, per-layer health, events, top hypotheses
    Watch(Watch),
    /// Where two runs part: the first step and layer whose health differs, the events only one
    /// has, both loss curves
    Diff(Diff),
    /// Run an unchanged training script, watch every model it trains and diagnose it (see
    /// `neuraldbg run --help`; needs the Python package: `python -m neuraldbg run`)
    #[command(disable_help_flag = true)]
    Run(RunScript),
}

#[derive(Debug, Args)]
pub struct Diff {
    /// The first trace (.ndbg): the run that worked, say
    pub a: PathBuf,
    /// The second trace (.ndbg)
    pub b: PathBuf,
    /// Print the comparison as a JSON object
    #[arg(long)]
    pub json: bool,
    /// Also write the comparison as a self-contained HTML page (both loss curves, where the
    /// runs part, the events only one run has)
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct RunScript {
    /// The options of `neuraldbg run`, the script and its arguments
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

#[derive(Debug, Args)]
pub struct Explain {
    /// The trace file (.ndbg). When `neuraldbg run --confirm` wrote NAME.confirm.json next to
    /// it, each hypothesis also shows its verdict and the numbers behind it, confirmed first
    pub trace: PathBuf,
    /// Print a JSON list of hypotheses (the CausalHypothesis fields, and `verdict`,
    /// `intervention` and `evidence` after `neuraldbg run --confirm`)
    #[arg(long)]
    pub json: bool,
    /// Only hypotheses about this failure (as `dbg.explain_failure(failure)`)
    #[arg(long, value_name = "FAILURE", value_parser = failure_names())]
    pub failure: Option<String>,
}

#[derive(Debug, Args)]
pub struct Events {
    /// The trace file (.ndbg)
    pub trace: PathBuf,
    /// Only events of this layer: a qualified module name from `model.named_modules()`,
    /// `<model>` for the root module, `(loss)` or `(input)`
    #[arg(long, value_name = "LAYER")]
    pub layer: Option<String>,
    /// Only events of this kind: an event type (gradient_health, activation_health,
    /// non_finite_output, data_anomaly, loss_health) or a health state the event enters
    /// (VANISHING, EXPLODING, SATURATED, NON_FINITE, HEALTHY, DEAD, ANOMALOUS, NORMAL, DIVERGING,
    /// PLATEAU, OUT_OF_DISTRIBUTION), in any case
    #[arg(long, value_name = "KIND", value_parser = kind_names(), hide_possible_values = true, ignore_case = true)]
    pub kind: Option<String>,
    /// Print a JSON list of events (the SemanticEvent fields)
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Events, hypotheses and per-layer histories in one JSON document (NaN and infinities,
    /// which JSON numbers cannot hold, are the strings "NaN", "inf" and "-inf"; the root
    /// module's name is "")
    Json,
    /// The causal graph as a Mermaid flowchart
    Mermaid,
    /// TensorBoard event files: per-layer gradient norms and run-wide series as scalars, the
    /// events and the diagnosis as text (`tensorboard --logdir OUT`)
    Tensorboard,
    /// Parquet tables in OUT: history.parquet (every per-layer and run-wide series, one row per
    /// series and step), events.parquet and hypotheses.parquet, for pandas, polars or DuckDB
    Parquet,
}

#[derive(Debug, Args)]
pub struct Export {
    /// The trace file (.ndbg)
    pub trace: PathBuf,
    #[arg(long, short, value_enum)]
    pub format: Format,
    /// Output file (json, mermaid; default: standard output) or directory (tensorboard,
    /// parquet; required)
    #[arg(long, short, value_name = "OUT")]
    pub output: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct Report {
    /// The trace file (.ndbg); the verdicts and loss curves of `neuraldbg run --confirm` are
    /// added when NAME.confirm.json is next to it
    pub trace: PathBuf,
    /// The HTML file to write (it loads nothing from the network; open it in any browser)
    #[arg(long, short, value_name = "OUT")]
    pub output: PathBuf,
    /// Title of the page (default: the trace's file name)
    #[arg(long)]
    pub title: Option<String>,
}

#[derive(Debug, Args)]
pub struct Watch {
    /// The trace file (.ndbg); it may not exist yet (the view waits for the run to create it)
    pub trace: PathBuf,
    /// Print one line per confirmed event and the verdict at the end, for logs and job
    /// schedulers (the default when standard output is not a terminal). Ends when the trace is
    /// closed, damaged, or its writer on this machine stopped
    #[arg(long)]
    pub plain: bool,
    /// Seconds between two looks at the file
    #[arg(long, value_name = "SECONDS", default_value_t = 0.5, value_parser = interval)]
    pub interval: f64,
}

fn interval(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.01..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "expected a number of seconds between 0.01 and 3600, got {text:?}"
        )),
    }
}

#[derive(Debug, Args)]
pub struct Info {
    /// The trace file (.ndbg)
    pub trace: PathBuf,
    /// Print the facts as a JSON object
    #[arg(long)]
    pub json: bool,
}

fn failure_names() -> PossibleValuesParser {
    PossibleValuesParser::new(
        neuraldbg_core::Failure::ALL
            .iter()
            .map(|f| f.as_str())
            .collect::<Vec<_>>(),
    )
}

/// Every name `--kind` accepts: event types, then states.
pub fn kind_list() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = EventType::ALL.iter().map(|e| e.as_str()).collect();
    let states = GradientHealth::ALL
        .iter()
        .map(|s| s.as_str())
        .chain(ActivationHealth::ALL.iter().map(|s| s.as_str()))
        .chain(LossHealth::ALL.iter().map(|s| s.as_str()))
        .chain(DataHealth::ALL.iter().map(|s| s.as_str()));
    for s in states {
        if !names.contains(&s) {
            names.push(s);
        }
    }
    names
}

fn kind_names() -> PossibleValuesParser {
    PossibleValuesParser::new(kind_list())
}
