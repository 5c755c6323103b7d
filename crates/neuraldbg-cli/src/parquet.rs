//! `neuraldbg export --format parquet`: the run's data as Parquet tables for pandas, polars,
//! `DuckDB` or Spark.
//!
//! Three files in the output directory: `history.parquet` (every series in long form, the rows of
//! `neuraldbg_core::table::history_table`, the same as Python's `dbg.to_pandas()`),
//! `events.parquet` (one row per semantic event) and `hypotheses.parquet` (the ranking). Written
//! with the Apache Parquet crate's column writer: no Arrow arrays in between, Snappy pages,
//! dictionary-encoded names.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use neuraldbg_core::Engine;
use neuraldbg_core::analysis::explain;
use neuraldbg_core::table::history_table;
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int64Type};
use parquet::errors::ParquetError;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

/// Rows per row group: large enough for fast scans, small enough to stream.
const ROW_GROUP: usize = 1 << 20;

/// One column's values, in schema order.
enum Column {
    /// Unsigned 64-bit integers (`INTEGER(64, false)`).
    U64(Vec<u64>),
    /// Nullable unsigned integers (the column must be `optional`).
    OptU64(Vec<Option<u64>>),
    F64(Vec<f64>),
    /// UTF-8 strings; None is null (the column must be `optional`).
    Str(Vec<Option<String>>),
    /// A list of strings per row (a `repeated binary` column).
    StrList(Vec<Vec<String>>),
}

impl Column {
    fn len(&self) -> usize {
        match self {
            Column::U64(v) => v.len(),
            Column::OptU64(v) => v.len(),
            Column::F64(v) => v.len(),
            Column::Str(v) => v.len(),
            Column::StrList(v) => v.len(),
        }
    }
}

/// Writes one table to `path`. `schema` is the Parquet message type; `columns` follow it.
fn write_table(path: &Path, schema: &str, columns: &[Column]) -> Result<(), ParquetError> {
    let schema = Arc::new(parse_message_type(schema)?);
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_created_by(format!("neuraldbg {}", env!("CARGO_PKG_VERSION")))
            .build(),
    );
    let file = File::create(path).map_err(|e| ParquetError::External(Box::new(e)))?;
    let mut writer = SerializedFileWriter::new(file, schema, props)?;
    let rows = columns.first().map_or(0, Column::len);
    let mut start = 0;
    loop {
        let end = (start + ROW_GROUP).min(rows);
        let mut group = writer.next_row_group()?;
        let mut index = 0;
        while let Some(mut col) = group.next_column()? {
            match &columns[index] {
                Column::U64(v) => {
                    // Parquet stores unsigned 64-bit integers in INT64 bits.
                    let bits: Vec<i64> = v[start..end]
                        .iter()
                        .map(|&x| i64::from_ne_bytes(x.to_ne_bytes()))
                        .collect();
                    col.typed::<Int64Type>().write_batch(&bits, None, None)?;
                }
                Column::OptU64(v) => {
                    let rows = &v[start..end];
                    let bits: Vec<i64> = rows
                        .iter()
                        .flatten()
                        .map(|&x| i64::from_ne_bytes(x.to_ne_bytes()))
                        .collect();
                    let defs: Vec<i16> = rows.iter().map(|s| i16::from(s.is_some())).collect();
                    col.typed::<Int64Type>()
                        .write_batch(&bits, Some(&defs), None)?;
                }
                Column::F64(v) => {
                    col.typed::<DoubleType>()
                        .write_batch(&v[start..end], None, None)?;
                }
                Column::Str(v) => {
                    let rows = &v[start..end];
                    let values: Vec<ByteArray> = rows
                        .iter()
                        .flatten()
                        .map(|s| ByteArray::from(s.as_str()))
                        .collect();
                    let defs: Vec<i16> = rows.iter().map(|s| i16::from(s.is_some())).collect();
                    col.typed::<ByteArrayType>()
                        .write_batch(&values, Some(&defs), None)?;
                }
                Column::StrList(v) => {
                    let (mut values, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
                    for row in &v[start..end] {
                        if row.is_empty() {
                            defs.push(0);
                            reps.push(0);
                        }
                        for (i, s) in row.iter().enumerate() {
                            values.push(ByteArray::from(s.as_str()));
                            defs.push(1);
                            reps.push(i16::from(i > 0));
                        }
                    }
                    col.typed::<ByteArrayType>()
                        .write_batch(&values, Some(&defs), Some(&reps))?;
                }
            }
            col.close()?;
            index += 1;
        }
        group.close()?;
        start = end;
        if start >= rows {
            break;
        }
    }
    writer.close()?;
    Ok(())
}

const HISTORY: &str = "message history {
    required int64 step (INTEGER(64, false));
    required int64 first_step (INTEGER(64, false));
    required binary group (STRING);
    optional binary layer (STRING);
    required binary metric (STRING);
    required double value;
    required double min;
    required double max;
}";

const EVENTS: &str = "message events {
    required int64 step (INTEGER(64, false));
    required binary layer (STRING);
    required binary event_type (STRING);
    required binary from_state (STRING);
    required binary to_state (STRING);
    required double confidence;
    required double value;
    required double threshold;
    required int64 confirmed_step (INTEGER(64, false));
}";

const HYPOTHESES: &str = "message hypotheses {
    required int64 rank (INTEGER(64, false));
    required binary failure (STRING);
    required binary cause (STRING);
    optional binary layer (STRING);
    optional int64 step (INTEGER(64, false));
    required double confidence;
    required binary description (STRING);
    repeated binary remedies (STRING);
}";

/// The history table's columns.
fn history_columns(engine: &Engine) -> Vec<Column> {
    let t = history_table(engine);
    let key = |r: &u32| &t.keys[*r as usize];
    vec![
        Column::U64(t.step.clone()),
        Column::U64(t.first_step.clone()),
        Column::Str(
            t.series
                .iter()
                .map(|r| Some(key(r).group.as_str().into()))
                .collect(),
        ),
        Column::Str(t.series.iter().map(|r| key(r).module.clone()).collect()),
        Column::Str(
            t.series
                .iter()
                .map(|r| Some(key(r).metric.into()))
                .collect(),
        ),
        Column::F64(t.value),
        Column::F64(t.min),
        Column::F64(t.max),
    ]
}

fn events_columns(engine: &Engine) -> Vec<Column> {
    let events = engine.events();
    let text = |f: &dyn Fn(&neuraldbg_core::SemanticEvent) -> String| {
        Column::Str(events.iter().map(|e| Some(f(e))).collect())
    };
    vec![
        Column::U64(events.iter().map(|e| e.step).collect()),
        text(&|e| engine.subject_name(e.subject)),
        text(&|e| e.event_type.as_str().into()),
        text(&|e| e.from_state.as_str().into()),
        text(&|e| e.to_state.as_str().into()),
        Column::F64(events.iter().map(|e| e.confidence).collect()),
        Column::F64(events.iter().map(|e| e.value).collect()),
        Column::F64(events.iter().map(|e| e.threshold).collect()),
        Column::U64(events.iter().map(|e| e.confirmed_step).collect()),
    ]
}

fn hypotheses_columns(engine: &Engine) -> Vec<Column> {
    let hs = explain(engine, None);
    vec![
        Column::U64((1..=hs.len() as u64).collect()),
        Column::Str(hs.iter().map(|h| Some(h.failure.as_str().into())).collect()),
        Column::Str(hs.iter().map(|h| Some(h.cause.as_str().into())).collect()),
        Column::Str(hs.iter().map(|h| h.layer.clone()).collect()),
        Column::OptU64(hs.iter().map(|h| h.step).collect()),
        Column::F64(hs.iter().map(|h| h.confidence).collect()),
        Column::Str(hs.iter().map(|h| Some(h.description.clone())).collect()),
        Column::StrList(hs.iter().map(|h| h.remedies.clone()).collect()),
    ]
}

/// Writes the three tables into `dir`; returns their paths.
pub fn export(engine: &Engine, dir: &Path) -> Result<Vec<std::path::PathBuf>, String> {
    let mut written = Vec::new();
    for (name, schema, columns) in [
        ("history", HISTORY, history_columns(engine)),
        ("events", EVENTS, events_columns(engine)),
        ("hypotheses", HYPOTHESES, hypotheses_columns(engine)),
    ] {
        let path = dir.join(format!("{name}.parquet"));
        write_table(&path, schema, &columns)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}
