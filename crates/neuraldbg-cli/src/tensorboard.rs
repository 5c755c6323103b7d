//! `TensorBoard` event files, written without `TensorFlow`.
//!
//! A file is a sequence of `TFRecord`s, each `length (u64 LE), masked CRC32C of the length,
//! data, masked CRC32C of the data`, whose data is a serialized `tensorboard.Event` protobuf.
//! The messages below are the subset of `event.proto`, `summary.proto`, `tensor.proto` and
//! `tensor_shape.proto` that scalars and text need, with `TensorBoard`'s field numbers.

use std::collections::BTreeMap;

use prost::Message;

#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
    #[prost(oneof = "Payload", tags = "2, 8")]
    pub payload: Option<Payload>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Payload {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `DataType` enum; [`DT_STRING`] for text.
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShapeProto>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// A scalar (rank 0) shape has no dimensions.
#[derive(Clone, PartialEq, Message)]
pub struct TensorShapeProto {}

pub const DT_STRING: i32 = 7;

/// A scalar value for the scalars dashboard.
pub fn scalar(tag: &str, value: f32) -> Value {
    Value {
        tag: tag.to_string(),
        metadata: None,
        payload: Some(Payload::SimpleValue(value)),
    }
}

/// A markdown string for the text dashboard.
pub fn text(tag: &str, markdown: &str) -> Value {
    Value {
        tag: tag.to_string(),
        metadata: Some(SummaryMetadata {
            plugin_data: Some(PluginData {
                plugin_name: "text".into(),
                content: Vec::new(),
            }),
        }),
        payload: Some(Payload::Tensor(TensorProto {
            dtype: DT_STRING,
            tensor_shape: Some(TensorShapeProto {}),
            string_val: vec![markdown.as_bytes().to_vec()],
        })),
    }
}

/// The `TFRecord` checksum: CRC32C rotated and offset, so data containing CRCs checksums well.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends one `TFRecord` holding `data`.
fn record(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// Summaries grouped by step, serialized as one event file.
#[derive(Debug, Default)]
pub struct EventFile {
    steps: BTreeMap<u64, Vec<Value>>,
}

impl EventFile {
    pub fn add(&mut self, step: u64, value: Value) {
        self.steps.entry(step).or_default().push(value);
    }

    /// The file's bytes: the version event (at `start`), then one event per step at the time
    /// `wall_time` gives it.
    pub fn to_bytes(&self, start: f64, wall_time: impl Fn(u64) -> f64) -> Vec<u8> {
        let mut out = Vec::new();
        let version = Event {
            wall_time: start,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        };
        record(&mut out, &version.encode_to_vec());
        for (&step, values) in &self.steps {
            let event = Event {
                wall_time: wall_time(step),
                step: i64::try_from(step).unwrap_or(i64::MAX),
                what: Some(What::Summary(Summary {
                    value: values.clone(),
                })),
            };
            record(&mut out, &event.encode_to_vec());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // TensorFlow's crc32c::Mask of the CRC of "", "a" and "123456789" (the CRC32C check
        // value 0xe3069283).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let mask = |c: u32| c.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc(b"123456789"), mask(0xe306_9283));
        assert_eq!(masked_crc(b""), 0xa282_ead8);
    }

    #[test]
    fn records_frame_the_events() {
        let mut file = EventFile::default();
        file.add(3, scalar("loss", 0.5));
        file.add(3, text("events", "hello"));
        let bytes = file.to_bytes(1.0, |_| 1.0);
        // Walk the records back.
        let mut events = Vec::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            assert_eq!(
                u32::from_le_bytes(rest[8..12].try_into().unwrap()),
                masked_crc(&rest[..8])
            );
            let data = &rest[12..12 + len];
            let crc = u32::from_le_bytes(rest[12 + len..16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            events.push(Event::decode(data).unwrap());
            rest = &rest[16 + len..];
        }
        assert_eq!(events.len(), 2);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("not a summary: {:?}", events[1]);
        };
        assert_eq!(events[1].step, 3);
        assert_eq!(s.value[0].payload, Some(Payload::SimpleValue(0.5)));
        assert_eq!(s.value[1].tag, "events");
    }
}
