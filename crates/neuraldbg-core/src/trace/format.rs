//! The bytes of a trace: preamble, record frames and the step encoding (docs/trace-format.md).
//!
//! Everything here is pure encoding and decoding of byte slices; files live in the writer and
//! the reader.

use crate::observation::{Fact, Measure, Observation, StepView};

/// First bytes of every trace. The high first byte and the CR LF / SUB bytes catch text-mode
/// transfers and `cat`-ing a trace, like PNG's signature.
pub const MAGIC: [u8; 8] = *b"\x89NDBG\r\n\x1a";
/// Format version written by this build; readers accept any version up to it. Version 2 added
/// the facts and measures blocks of a step (flags 6 and 7); a version-1 file is a valid
/// version-2 file without them.
pub const VERSION: u16 = 2;
/// Preamble: magic, version (u16), reserved (u16, zero), CRC32C of the 12 bytes before it.
pub const PREAMBLE_LEN: usize = 16;
/// Frame header: payload length (u32), kind (u8), three zero bytes, CRC32C of those 8 bytes.
pub const FRAME_HEADER_LEN: usize = 12;
/// Bytes a frame adds around its payload: the header and the payload's CRC32C.
pub const FRAME_OVERHEAD: usize = FRAME_HEADER_LEN + 4;
/// Largest payload a reader accepts; a larger length can only come from a bug.
pub const MAX_PAYLOAD: u32 = 1 << 30;

/// What a record holds. Kinds from [`OPTIONAL_KINDS`] on may be skipped by readers that do
/// not know them; an unknown kind below it is damage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// JSON: the engine configuration, the model description, free-form metadata.
    Header = 1,
    /// Binary: one [`Observation`].
    Step = 2,
    /// Binary: the number of step records written; present only when the writer closed.
    End = 3,
    /// JSON: steps the run took that were not observed, and why ([`super::Unobserved`]).
    /// Optional: a reader that predates it skips it and reads the steps around it.
    Unobserved = 0x81,
    /// JSON: the wall-clock time a step was written ([`super::Clock`]), at most about once a
    /// second. Optional.
    Clock = 0x82,
    /// JSON: the per-parameter lrs of an optimizer first seen stepping after the header was
    /// written ([`crate::Engine::amend_param_lr`]). Optional: a reader that predates it skips
    /// it and reads the parameters as the header's lrs say.
    ParamLr = 0x83,
    /// JSON: the first training batch's facts ([`crate::FirstBatch`]), read after the header
    /// was written ([`crate::Engine::amend_first_batch`]). Optional: a reader that predates it
    /// skips it and reads the model as the header describes it.
    FirstBatch = 0x84,
}

pub const OPTIONAL_KINDS: u8 = 0x80;

impl Kind {
    pub fn from_u8(k: u8) -> Option<Self> {
        match k {
            1 => Some(Kind::Header),
            2 => Some(Kind::Step),
            3 => Some(Kind::End),
            0x81 => Some(Kind::Unobserved),
            0x82 => Some(Kind::Clock),
            0x83 => Some(Kind::ParamLr),
            0x84 => Some(Kind::FirstBatch),
            _ => None,
        }
    }
}

pub fn preamble() -> [u8; PREAMBLE_LEN] {
    let mut p = [0u8; PREAMBLE_LEN];
    p[..8].copy_from_slice(&MAGIC);
    p[8..10].copy_from_slice(&VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&p[..12]);
    p[12..].copy_from_slice(&crc.to_le_bytes());
    p
}

/// What the first bytes of a file say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preamble {
    /// A trace of this version.
    Trace(u16),
    /// Not a trace at all.
    Foreign,
    /// Starts like a trace but the preamble is cut short or its checksum fails.
    Damaged,
}

pub fn check_preamble(bytes: &[u8]) -> Preamble {
    let n = bytes.len().min(MAGIC.len());
    if bytes[..n] != MAGIC[..n] || bytes.is_empty() {
        return Preamble::Foreign;
    }
    if bytes.len() < PREAMBLE_LEN {
        return Preamble::Damaged;
    }
    let crc = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    if crc != crc32c::crc32c(&bytes[..12]) {
        return Preamble::Damaged;
    }
    Preamble::Trace(u16::from_le_bytes([bytes[8], bytes[9]]))
}

/// Appends one framed record to `out`.
pub fn frame(out: &mut Vec<u8>, kind: u8, payload: &[u8]) {
    let len = u32::try_from(payload.len()).expect("payload checked against MAX_PAYLOAD");
    let mut head = [0u8; FRAME_HEADER_LEN];
    head[..4].copy_from_slice(&len.to_le_bytes());
    head[4] = kind;
    let crc = crc32c::crc32c(&head[..8]);
    head[8..].copy_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(payload);
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
}

/// A frame header that passed its checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub len: u32,
    pub kind: u8,
}

/// Why a frame header is not valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadHeader {
    Checksum,
    Reserved,
    TooLong(u32),
}

pub fn parse_frame_header(h: &[u8; FRAME_HEADER_LEN]) -> Result<FrameHeader, BadHeader> {
    let crc = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if crc != crc32c::crc32c(&h[..8]) {
        return Err(BadHeader::Checksum);
    }
    if h[5..8] != [0, 0, 0] {
        return Err(BadHeader::Reserved);
    }
    let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if len > MAX_PAYLOAD {
        return Err(BadHeader::TooLong(len));
    }
    Ok(FrameHeader { len, kind: h[4] })
}

/// Checks a payload against the CRC32C stored after it.
pub fn payload_ok(payload: &[u8], crc: [u8; 4]) -> bool {
    crc32c::crc32c(payload) == u32::from_le_bytes(crc)
}

const HAS_WEIGHTS: u8 = 1;
const HAS_ACTIVATIONS: u8 = 2;
const HAS_LOSS: u8 = 4;
const HAS_LR: u8 = 8;
const HAS_NONFINITE: u8 = 16;
/// The step's module outputs were scanned for NaN/Inf (no payload).
const OUTPUTS_CHECKED: u8 = 32;
/// A facts block follows the arrays (format version 2).
const HAS_FACTS: u8 = 64;
/// A measures block follows the facts (format version 2).
const HAS_MEASURES: u8 = 128;

/// Size of the fixed part of a step payload: step (u64), flags (u8), four array lengths (u32).
const STEP_HEAD: usize = 8 + 1 + 4 * 4;

/// Why a step cannot be encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TooLarge {
    Array(&'static str, usize),
    Module(usize),
    Payload(usize),
    /// More than 65,535 facts or measures in one step.
    Block(&'static str, usize),
}

fn count(what: &'static str, a: &[f32]) -> Result<u32, TooLarge> {
    u32::try_from(a.len()).map_err(|_| TooLarge::Array(what, a.len()))
}

/// Encodes a step into `out` (cleared first). Layout, all little-endian:
/// `step u64, flags u8, n_grad u32, n_weight u32, n_act u32, n_input u32,
/// [loss f64], [lr f64], [nonfinite_module u32], grad f32*, weight f32*, act f32*, input f32*`.
/// Absent optional arrays have length 0 and their flag clear.
pub fn encode_step(out: &mut Vec<u8>, v: &StepView<'_>) -> Result<(), TooLarge> {
    out.clear();
    let weights = v.weight_norms.unwrap_or(&[]);
    let acts = v.activations.unwrap_or(&[]);
    let mut flags = 0u8;
    for (present, bit) in [
        (v.weight_norms.is_some(), HAS_WEIGHTS),
        (v.activations.is_some(), HAS_ACTIVATIONS),
        (v.loss.is_some(), HAS_LOSS),
        (v.lr.is_some(), HAS_LR),
        (v.nonfinite_module.is_some(), HAS_NONFINITE),
        (v.outputs_checked, OUTPUTS_CHECKED),
        (!v.facts.is_empty(), HAS_FACTS),
        (!v.measures.is_empty(), HAS_MEASURES),
    ] {
        if present {
            flags |= bit;
        }
    }
    let counts = [
        count("grad_norms", v.grad_norms)?,
        count("weight_norms", weights)?,
        count("activations", acts)?,
        count("inputs", v.inputs)?,
    ];
    let n_facts =
        u16::try_from(v.facts.len()).map_err(|_| TooLarge::Block("facts", v.facts.len()))?;
    let n_measures = u16::try_from(v.measures.len())
        .map_err(|_| TooLarge::Block("measures", v.measures.len()))?;
    let floats = v.grad_norms.len() + weights.len() + acts.len() + v.inputs.len();
    let facts_size: usize = v.facts.iter().map(|(f, _)| 1 + f.as_str().len() + 8).sum();
    let measures_size: usize = v
        .measures
        .iter()
        .map(|(m, a)| 1 + m.as_str().len() + 4 + 4 * a.len())
        .sum();
    let size = STEP_HEAD + 8 + 8 + 4 + 4 * floats + 2 + facts_size + 2 + measures_size;
    if size > MAX_PAYLOAD as usize {
        return Err(TooLarge::Payload(size));
    }
    out.reserve(size);
    out.extend_from_slice(&v.step.to_le_bytes());
    out.push(flags);
    for c in counts {
        out.extend_from_slice(&c.to_le_bytes());
    }
    if let Some(loss) = v.loss {
        out.extend_from_slice(&loss.to_le_bytes());
    }
    if let Some(lr) = v.lr {
        out.extend_from_slice(&lr.to_le_bytes());
    }
    if let Some(m) = v.nonfinite_module {
        let m = u32::try_from(m).map_err(|_| TooLarge::Module(m))?;
        out.extend_from_slice(&m.to_le_bytes());
    }
    for a in [v.grad_norms, weights, acts, v.inputs] {
        put_f32s(out, a);
    }
    if !v.facts.is_empty() {
        out.extend_from_slice(&n_facts.to_le_bytes());
        for (fact, value) in v.facts {
            put_name(out, fact.as_str());
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    if !v.measures.is_empty() {
        out.extend_from_slice(&n_measures.to_le_bytes());
        for (measure, values) in v.measures {
            put_name(out, measure.as_str());
            out.extend_from_slice(&count(measure.as_str(), values)?.to_le_bytes());
            put_f32s(out, values);
        }
    }
    Ok(())
}

/// A vocabulary name (always shorter than 256 bytes) with its length.
fn put_name(out: &mut Vec<u8>, name: &str) {
    out.push(u8::try_from(name.len()).expect("vocabulary names are short"));
    out.extend_from_slice(name.as_bytes());
}

/// Appends floats in little-endian order: a plain copy on little-endian machines.
fn put_f32s(out: &mut Vec<u8>, a: &[f32]) {
    #[cfg(target_endian = "little")]
    out.extend_from_slice(bytemuck::cast_slice(a));
    #[cfg(target_endian = "big")]
    for x in a {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Reads little-endian floats (`bytes.len()` is a multiple of 4).
fn get_f32s(bytes: &[u8]) -> Vec<f32> {
    #[cfg(target_endian = "little")]
    return bytemuck::pod_collect_to_vec(bytes);
    #[cfg(target_endian = "big")]
    return bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
}

/// A cursor over a payload that never reads past its end.
struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.bytes.len() < n {
            return Err(format!(
                "the step record is {} bytes too short",
                n - self.bytes.len()
            ));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u16(&mut self) -> Result<u16, String> {
        self.array().map(u16::from_le_bytes)
    }

    fn name(&mut self) -> Result<&'a str, String> {
        let [n] = self.array()?;
        std::str::from_utf8(self.take(usize::from(n))?)
            .map_err(|_| "a fact or measure name is not UTF-8".to_string())
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn f64(&mut self) -> Result<f64, String> {
        self.array().map(f64::from_le_bytes)
    }

    fn floats(&mut self, n: u32) -> Result<Vec<f32>, String> {
        self.take(n as usize * 4).map(get_f32s)
    }
}

/// Decodes a step payload; the error says what is inconsistent.
pub fn decode_step(payload: &[u8]) -> Result<Observation, String> {
    let mut c = Cursor { bytes: payload };
    let step = u64::from_le_bytes(c.array()?);
    // Every bit of the flags byte has a meaning; new fields go into the named blocks.
    let [flags] = c.array()?;
    let [n_grad, n_weight, n_act, n_input] = [c.u32()?, c.u32()?, c.u32()?, c.u32()?];
    let has = |bit: u8| flags & bit != 0;
    if (!has(HAS_WEIGHTS) && n_weight != 0) || (!has(HAS_ACTIVATIONS) && n_act != 0) {
        return Err("an absent array has a non-zero length".into());
    }
    let floats = u64::from(n_grad) + u64::from(n_weight) + u64::from(n_act) + u64::from(n_input);
    let fixed = 8 * u64::from(has(HAS_LOSS))
        + 8 * u64::from(has(HAS_LR))
        + 4 * u64::from(has(HAS_NONFINITE));
    let expected = STEP_HEAD as u64 + fixed + 4 * floats;
    let blocks = has(HAS_FACTS) || has(HAS_MEASURES);
    // Without blocks the counts fix the length; with them, the blocks are read to their end
    // and the payload must end there.
    if (!blocks && expected != payload.len() as u64) || expected > payload.len() as u64 {
        return Err(format!(
            "the step record holds {} bytes but its lengths say {expected}",
            payload.len()
        ));
    }
    let loss = has(HAS_LOSS).then(|| c.f64()).transpose()?;
    let lr = has(HAS_LR).then(|| c.f64()).transpose()?;
    let nonfinite_module = has(HAS_NONFINITE)
        .then(|| c.u32().map(|m| m as usize))
        .transpose()?;
    let grad_norms = c.floats(n_grad)?;
    let weight_norms = has(HAS_WEIGHTS).then(|| c.floats(n_weight)).transpose()?;
    let activations = has(HAS_ACTIVATIONS).then(|| c.floats(n_act)).transpose()?;
    let inputs = c.floats(n_input)?;
    // Names this build does not know come from a newer writer: skipped, not damage.
    let mut facts = Vec::new();
    if has(HAS_FACTS) {
        for _ in 0..c.u16()? {
            let name = c.name()?;
            let value = c.f64()?;
            if let Some(fact) = Fact::parse(name) {
                facts.push((fact, value));
            }
        }
    }
    let mut measures = Vec::new();
    if has(HAS_MEASURES) {
        for _ in 0..c.u16()? {
            let name = c.name()?;
            let n = c.u32()?;
            let values = c.floats(n)?;
            if let Some(measure) = Measure::parse(name) {
                measures.push((measure, values));
            }
        }
    }
    if !c.bytes.is_empty() {
        return Err(format!(
            "the step record has {} bytes after its last block",
            c.bytes.len()
        ));
    }
    Ok(Observation {
        step,
        grad_norms,
        weight_norms,
        activations,
        inputs,
        loss,
        lr,
        nonfinite_module,
        outputs_checked: has(OUTPUTS_CHECKED),
        facts,
        measures,
    })
}

/// The payload of a param-lr record: `{"param_lr": [0.1, null, ...]}`, or `{"param_lr": null}`
/// for an optimizer whose lrs cannot be read. The key is required (a missing one is not read as
/// null).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ParamLrPayload {
    #[serde(deserialize_with = "Option::deserialize")]
    pub param_lr: Option<Vec<Option<f64>>>,
}

/// The end record: the number of step records written.
pub fn encode_end(steps: u64) -> [u8; 8] {
    steps.to_le_bytes()
}

pub fn decode_end(payload: &[u8]) -> Result<u64, String> {
    <[u8; 8]>::try_from(payload)
        .map(u64::from_le_bytes)
        .map_err(|_| format!("the end record holds {} bytes, expected 8", payload.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn preamble_round_trip_and_foreign_files() {
        assert_eq!(check_preamble(&preamble()), Preamble::Trace(VERSION));
        assert_eq!(check_preamble(b"{\"json\": 1}"), Preamble::Foreign);
        assert_eq!(check_preamble(b""), Preamble::Foreign);
        assert_eq!(check_preamble(&preamble()[..5]), Preamble::Damaged);
        let mut p = preamble();
        p[9] ^= 1;
        assert_eq!(check_preamble(&p), Preamble::Damaged);
    }

    #[test]
    fn frame_header_detects_every_single_bit_flip() {
        let mut out = Vec::new();
        frame(&mut out, Kind::Step as u8, b"abc");
        let head: [u8; FRAME_HEADER_LEN] = out[..FRAME_HEADER_LEN].try_into().unwrap();
        assert_eq!(
            parse_frame_header(&head),
            Ok(FrameHeader {
                len: 3,
                kind: Kind::Step as u8
            })
        );
        for bit in 0..FRAME_HEADER_LEN * 8 {
            let mut h = head;
            h[bit / 8] ^= 1 << (bit % 8);
            assert!(parse_frame_header(&h).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn unknown_fact_and_measure_names_are_skipped() {
        // A newer writer's names: the block is read past and the rest of the step kept.
        let obs = Observation {
            step: 4,
            grad_norms: vec![0.5],
            facts: vec![(Fact::Training, 1.0), (Fact::Rank, 3.0)],
            measures: vec![(Measure::OutputAbsMax, vec![1.0, 2.0])],
            ..Observation::default()
        };
        let mut buf = Vec::new();
        encode_step(&mut buf, &obs.view()).unwrap();
        let rename = |buf: &mut Vec<u8>, from: &str, to: &str| {
            assert_eq!(from.len(), to.len());
            let at = buf
                .windows(from.len())
                .position(|w| w == from.as_bytes())
                .unwrap();
            buf[at..at + to.len()].copy_from_slice(to.as_bytes());
        };
        rename(&mut buf, "rank", "zzzz");
        rename(&mut buf, "output_absmax", "zzzzzzzzzzzzz");
        let back = decode_step(&buf).unwrap();
        assert_eq!(back.facts, vec![(Fact::Training, 1.0)]);
        assert!(back.measures.is_empty());
        assert_eq!(back.grad_norms, vec![0.5]);
    }

    proptest! {
        /// Every observation survives encoding bit for bit (NaN payloads and signed zeros too).
        #[test]
        fn step_round_trip(
            step in any::<u64>(),
            grads in proptest::collection::vec(any::<f32>(), 0..40),
            weights in proptest::option::of(proptest::collection::vec(any::<f32>(), 0..40)),
            acts in proptest::option::of(proptest::collection::vec(any::<f32>(), 0..40)),
            inputs in proptest::collection::vec(any::<f32>(), 0..12),
            loss in proptest::option::of(any::<f64>()),
            lr in proptest::option::of(any::<f64>()),
            module in proptest::option::of(0usize..100_000),
            checked in any::<bool>(),
            facts in proptest::collection::vec((proptest::sample::select(Fact::ALL), any::<f64>()), 0..4),
            measures in proptest::collection::vec((proptest::sample::select(Measure::ALL), proptest::collection::vec(any::<f32>(), 0..20)), 0..3),
        ) {
            let obs = Observation { step, grad_norms: grads, weight_norms: weights, activations: acts, inputs, loss, lr, nonfinite_module: module, outputs_checked: checked, facts, measures };
            let mut buf = Vec::new();
            encode_step(&mut buf, &obs.view()).unwrap();
            let back = decode_step(&buf).unwrap();
            prop_assert_eq!(back.step, obs.step);
            prop_assert_eq!(bits(&back.grad_norms), bits(&obs.grad_norms));
            prop_assert_eq!(back.weight_norms.as_deref().map(bits), obs.weight_norms.as_deref().map(bits));
            prop_assert_eq!(back.activations.as_deref().map(bits), obs.activations.as_deref().map(bits));
            prop_assert_eq!(bits(&back.inputs), bits(&obs.inputs));
            prop_assert_eq!(back.loss.map(f64::to_bits), obs.loss.map(f64::to_bits));
            prop_assert_eq!(back.lr.map(f64::to_bits), obs.lr.map(f64::to_bits));
            prop_assert_eq!(back.nonfinite_module, obs.nonfinite_module);
            prop_assert_eq!(back.outputs_checked, obs.outputs_checked);
            let fact_bits = |f: &[(Fact, f64)]| f.iter().map(|(k, v)| (*k, v.to_bits())).collect::<Vec<_>>();
            prop_assert_eq!(fact_bits(&back.facts), fact_bits(&obs.facts));
            let measure_bits = |m: &[(Measure, Vec<f32>)]| m.iter().map(|(k, v)| (*k, bits(v))).collect::<Vec<_>>();
            prop_assert_eq!(measure_bits(&back.measures), measure_bits(&obs.measures));
            // Any shorter or longer payload is refused, never misread.
            for cut in 0..buf.len() {
                prop_assert!(decode_step(&buf[..cut]).is_err());
            }
            buf.push(0);
            prop_assert!(decode_step(&buf).is_err());
        }

        /// Arbitrary bytes never panic the step decoder.
        #[test]
        fn decode_step_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_step(&bytes);
        }
    }
}
