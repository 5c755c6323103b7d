//! Human-readable lines, identical to what the Python package prints (`print(h)`, `print(e)`
//! in `python/neuraldbg/types.py`), so a diagnosis reads the same live and post-mortem.

use neuraldbg_core::{CausalHypothesis, Engine, SemanticEvent, display_name};

/// Python's `format(x, ".2f")`.
fn fixed2(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{x:.2}")
    }
}

/// Python's `format(x, ".3g")` for a finite `x`: three significant digits, fixed notation for
/// decimal exponents in [-4, 3), else scientific with a signed two-digit exponent; trailing
/// zeros dropped. Both languages round the exact binary value half to even.
pub fn general3(x: f64) -> String {
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    let sci = format!("{x:.2e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let trim = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if (-4..3).contains(&exp) {
        let decimals = (2 - exp) as usize;
        trim(&format!("{x:.decimals$}"))
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trim(mantissa), exp.abs())
    }
}

/// `str(hypothesis)` in Python (the core's `Display`).
pub fn hypothesis_line(h: &CausalHypothesis) -> String {
    h.to_string()
}

/// `str(event)` in Python.
pub fn event_line(engine: &Engine, e: &SemanticEvent) -> String {
    let shown = if e.value.is_finite() {
        format!(" value={}", general3(e.value))
    } else {
        String::new()
    };
    format!(
        "step {:>6}  {}  {}: {} -> {}{shown} (confidence {})",
        e.step,
        display_name(&engine.subject_name(e.subject)),
        e.event_type,
        e.from_state,
        e.to_state,
        fixed2(e.confidence)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn general3_matches_python() {
        // Expected values printed by CPython's format(x, ".3g").
        let cases = [
            (0.125, "0.125"),
            (1.125e-7, "1.12e-07"),
            (2.5e-8, "2.5e-08"),
            (1000.0, "1e+03"),
            (999.5, "1e+03"),
            (0.000_123_4, "0.000123"),
            (0.000_099_99, "0.0001"),
            (12345.0, "1.23e+04"),
            (0.00015, "0.00015"),
            (-3.0, "-3"),
            (123.0, "123"),
            (99.95, "100"),
            (1e100, "1e+100"),
            (0.0, "0"),
            (0.1, "0.1"),
            (1.0 / 3.0, "0.333"),
        ];
        for (x, want) in cases {
            assert_eq!(general3(x), want, "{x}");
        }
    }

    #[test]
    fn fixed2_rounds_like_python() {
        assert_eq!(fixed2(0.125), "0.12");
        assert_eq!(fixed2(0.375), "0.38");
        assert_eq!(fixed2(1.0), "1.00");
        assert_eq!(fixed2(f64::NAN), "nan");
    }
}
