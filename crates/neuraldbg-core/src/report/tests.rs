use super::*;
use crate::Config;
use crate::model::ModelSpec;
use crate::observation::Observation;
use serde_json::Value;

/// `n` Linear+Tanh blocks, one weight parameter per Linear, root last.
fn spec(n: usize, name: impl Fn(usize) -> String) -> ModelSpec {
    let mut spec = ModelSpec::default();
    for i in 0..n {
        let fc = spec.module(name(i), "Linear");
        spec.param(fc, format!("{}.weight", name(i)), &[16, 16]);
        spec.module(format!("act{i}"), "Tanh");
    }
    spec.module("", "Sequential");
    spec.optimizer = Some("SGD".into());
    spec
}

fn engine(n: usize, config: Config) -> Engine {
    let mut e = Engine::new(config).unwrap();
    e.register_model(spec(n, |i| format!("fc{i}"))).unwrap();
    e
}

fn observe(e: &mut Engine, step: u64, norms: Vec<f32>, loss: f64) {
    e.observe(
        &Observation {
            step,
            grad_norms: norms,
            loss: Some(loss),
            ..Observation::default()
        }
        .view(),
    )
    .unwrap();
}

/// The embedded JSON, parsed.
fn data(html: &str) -> Value {
    let open = "<script type=\"application/json\" id=\"ndbg-data\">";
    let start = html.find(open).unwrap() + open.len();
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).unwrap()
}

fn unbase64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let bytes: Vec<u8> = text.bytes().collect();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let n = chunk
            .iter()
            .take_while(|&&c| c != b'=')
            .fold(0u32, |n, &c| (n << 6) | u32::from(value(c)));
        let got = chunk.iter().take_while(|&&c| c != b'=').count();
        let n = n << (6 * (4 - got));
        out.extend(
            [(n >> 16) as u8, (n >> 8) as u8, n as u8]
                .into_iter()
                .take(got - 1),
        );
    }
    out
}

/// `(min code, max code)` of heatmap cell `(row, col)`.
fn cell(d: &Value, row: usize, col: usize) -> (u8, u8) {
    let codes = unbase64(d["heatmap"]["codes"].as_str().unwrap());
    let cols = d["columns"].as_array().unwrap().len();
    let i = (row * cols + col) * 2;
    (codes[i], codes[i + 1])
}

/// The column covering `step`.
fn column_of(d: &Value, step: u64) -> usize {
    d["columns"]
        .as_array()
        .unwrap()
        .iter()
        .position(|c| c[0].as_u64().unwrap() <= step && step <= c[1].as_u64().unwrap())
        .unwrap()
}

#[test]
fn base64_round_trips() {
    for n in 0..10 {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 200) as u8).collect();
        assert_eq!(unbase64(&base64(&bytes)), bytes);
    }
    assert_eq!(base64(b"Man"), "TWFu");
    assert_eq!(base64(b"Ma"), "TWE=");
}

#[test]
fn nan_and_spike_survive_and_the_verdict_leads() {
    // A long run in a history that keeps every step: the report must merge 3,000 buckets into
    // at most MAX_COLUMNS columns without losing the NaN at step 2,000 or the spike at 1,234.
    let config = Config {
        history_capacity: 4096,
        ..Config::default()
    };
    let mut e = engine(8, config);
    for step in 0..3000u64 {
        let mut norms = vec![0.05f32; 8];
        if step == 1234 {
            norms[3] = 5e4;
        }
        if step >= 2000 {
            norms[5] = f32::NAN;
        }
        observe(&mut e, step, norms, 1.0);
    }
    let html = render_html(&e, "planted NaN");
    let d = data(&html);
    let cols = d["columns"].as_array().unwrap();
    assert!(
        cols.len() <= MAX_COLUMNS && cols.len() >= MAX_COLUMNS / 2,
        "{}",
        cols.len()
    );
    assert_eq!(cols[0][0], 0);
    assert_eq!(cols.last().unwrap()[1], 2999);

    let spike = cell(&d, 3, column_of(&d, 1234));
    let next = cell(&d, 3, column_of(&d, 1234) + 1);
    assert!(
        spike.1 > next.1 + 50,
        "the spike column stands out: {spike:?} vs {next:?}"
    );
    let lo = d["heatmap"]["log_lo"].as_f64().unwrap();
    let hi = d["heatmap"]["log_hi"].as_f64().unwrap();
    let decoded = lo + f64::from(spike.1 - CODE_FIRST) / CODE_LEVELS * (hi - lo);
    assert!((decoded - 5e4f64.log10()).abs() < 0.1, "{decoded}");
    let nan = column_of(&d, 2000);
    assert_eq!(cell(&d, 5, nan).1, CODE_NON_FINITE);
    assert_ne!(
        cell(&d, 5, nan - 1).1,
        CODE_NON_FINITE,
        "finite before step 2000"
    );
    assert_ne!(cell(&d, 4, nan).1, CODE_NON_FINITE, "only the NaN layer");

    // The NaN layer's curve is drawn, and its NaN reaches the page as "NaN", not null.
    let curves = d["curves"].as_array().unwrap();
    let fc5 = curves.iter().find(|c| c["name"] == "fc5").unwrap();
    assert_eq!(fc5["max"].as_array().unwrap().last().unwrap(), "NaN");
    assert_eq!(d["focus"]["layer"], "fc5");
    assert_eq!(d["focus"]["step"], 2000);
    assert_eq!(d["focus"]["rows"], serde_json::json!([5.0, 6.0]));

    // The verdict comes first, with the top hypothesis' sentence and remedies.
    let top = &Analysis::new(&e).unwrap().hypotheses(None)[0];
    assert_eq!(top.failure.as_str(), "non_finite");
    let verdict = html.find("id=\"verdict\"").unwrap();
    let heatmap = html.find("id=\"heatmap-section\"").unwrap();
    let sentence = html.find(&rich(&top.description)).unwrap();
    assert!(verdict < sentence && sentence < heatmap);
    assert!(html.contains(&rich(&top.remedies[0])));
}

#[test]
fn vanishing_and_zero_keep_their_minimum() {
    let config = Config {
        history_capacity: 4096,
        ..Config::default()
    };
    let mut e = engine(3, config);
    for step in 0..2000u64 {
        let dip = if step == 700 { 1e-9 } else { 0.05 };
        let zero = if step >= 1500 { 0.0 } else { 0.05 };
        observe(&mut e, step, vec![dip, 0.05, zero], 1.0);
    }
    let d = data(&render_html(&e, "dips"));
    let (min, max) = cell(&d, 0, column_of(&d, 700));
    assert!(
        min < 60 && max > 100,
        "the one-step dip keeps its minimum: {min} {max}"
    );
    assert_eq!(cell(&d, 2, column_of(&d, 1600)), (CODE_ZERO, CODE_ZERO));
    assert_eq!(
        cell(&d, 1, 0),
        cell(&d, 1, 100),
        "a constant layer is one colour"
    );
}

#[test]
fn a_layer_without_gradient_is_empty_not_non_finite() {
    let mut e = engine(2, Config::default());
    for step in 0..20u64 {
        // Negative: no gradient this step (a frozen layer).
        observe(&mut e, step, vec![0.1, -1.0], 1.0);
    }
    let d = data(&render_html(&e, "frozen"));
    assert_eq!(cell(&d, 1, 3), (CODE_EMPTY, CODE_EMPTY));
    assert_ne!(cell(&d, 0, 3).0, CODE_EMPTY);
}

#[test]
fn healthy_run_says_so_and_highlights_nothing() {
    let mut e = engine(4, Config::default());
    for step in 0..200u64 {
        observe(
            &mut e,
            step,
            vec![0.1, 0.05, 0.02, 0.01],
            2.0 / (1.0 + step as f64),
        );
    }
    let html = render_html(&e, "healthy");
    assert!(html.contains("No failure detected"), "verdict");
    let d = data(&html);
    assert!(d["focus"].is_null());
    assert!(d["loss"]["last"].as_array().unwrap().len() > 10);
    assert!(!d["curves"].as_array().unwrap().is_empty());
}

#[test]
fn names_cannot_break_out_of_the_page() {
    let mut e = Engine::new(Config::default()).unwrap();
    e.register_model(spec(2, |i| format!("</script><b>x{i}</b>")))
        .unwrap();
    for step in 0..30u64 {
        let norm = if step >= 10 { f32::NAN } else { 0.1 };
        observe(&mut e, step, vec![norm, 0.1], 1.0);
    }
    let html = render_html(&e, "<img src=x onerror=alert(1)> {{DATA}}");
    assert_eq!(html.matches("</script>").count(), 2, "only the page's own");
    assert!(!html.contains("<img src=x"));
    assert!(!html.contains("<b>x0"));
    assert!(html.contains("{{DATA}}"), "a title is not a placeholder");
    let d = data(&html);
    assert_eq!(d["heatmap"]["rows"][0]["name"], "</script><b>x0</b>");
}

#[test]
fn engine_without_model_or_steps_renders() {
    let e = Engine::new(Config::default()).unwrap();
    let html = render_html(&e, "empty");
    assert!(html.contains("no training step was observed"));
    assert!(data(&html).is_null());
    let e = engine(3, Config::default());
    let html = render_html(&e, "registered only");
    assert!(html.contains("no training step was observed"));
    assert_eq!(data(&html)["columns"].as_array().unwrap().len(), 0);
}

#[test]
fn activation_root_marks_the_boundary_and_blocks_span_their_layers() {
    let e = engine(4, Config::default());
    let model = e.model().unwrap();
    // act1 runs after fc1 (layer 1): the boundary between rows 1 and 2.
    assert_eq!(
        layer_span(model, model.module_index("act1").unwrap()),
        (2, 2)
    );
    assert_eq!(
        layer_of(model, model.module_index("act1").unwrap()),
        Some(1)
    );
    assert_eq!(
        layer_span(model, model.module_index("fc2").unwrap()),
        (2, 3)
    );
    assert_eq!(layer_span(model, model.module_index("").unwrap()), (0, 4));
}

/// 1,000 layers x 100,000 steps of synthetic observations: the page stays a few MB and every
/// layer keeps its own row. The time is reported, not asserted (`--nocapture` shows it).
#[test]
fn scale_1000_layers_100k_steps() {
    let (layers, steps) = (1000usize, 100_000u64);
    let mut e = engine(layers, Config::default());
    // Norms shrink with depth; the first 300 layers vanish from step 60,000; one NaN.
    let healthy: Vec<f32> = (0..layers).map(|l| 0.5 * 0.99f32.powf(l as f32)).collect();
    let mut vanished = healthy.clone();
    vanished[..300].fill(1e-8);
    let t0 = std::time::Instant::now();
    for step in 0..steps {
        let mut norms = if step < 60_000 {
            healthy.clone()
        } else {
            vanished.clone()
        };
        if step == 77_777 {
            norms[640] = f32::NAN;
        }
        observe(&mut e, step, norms, 1.0);
    }
    let observed = t0.elapsed();
    let t1 = std::time::Instant::now();
    let html = render_html(&e, "scale");
    let rendered = t1.elapsed();
    let d = data(&html);
    eprintln!(
        "report for {layers} layers x {steps} steps: {:.2} MB, generated in {:.0} ms \
         (observing took {:.1} s)",
        html.len() as f64 / 1e6,
        rendered.as_secs_f64() * 1e3,
        observed.as_secs_f64()
    );
    assert!(html.len() < 4_000_000, "{} bytes", html.len());
    assert_eq!(d["heatmap"]["rows"].as_array().unwrap().len(), layers);
    assert!(d["columns"].as_array().unwrap().len() <= MAX_COLUMNS);
    assert_eq!(cell(&d, 640, column_of(&d, 77_777)).1, CODE_NON_FINITE);
    assert!(d["events"].as_array().unwrap().len() <= MAX_EVENTS);
}

/// An exploding run and the `--confirm` file of its first two hypotheses: the second
/// confirmed, the first refuted; two runs' losses, the unchanged one non-finite from step 12.
fn confirmed_run() -> (Engine, Vec<CausalHypothesis>, Confirmation) {
    let mut e = engine(4, Config::default());
    for step in 0..30u64 {
        let norm = if step < 10 { 0.05 } else { 5e4 * step as f32 };
        observe(&mut e, step, vec![norm; 4], 1.0 + step as f64);
    }
    let hyps = Analysis::new(&e).unwrap().hypotheses(None);
    assert!(hyps.len() >= 2, "{hyps:?}");
    let verdict = |h: &CausalHypothesis, verdict: &str, loss: f64| {
        serde_json::json!({"failure": h.failure.as_str(), "cause": h.cause.as_str(),
            "layer": h.layer, "step": h.step, "verdict": verdict, "intervention": format!("fix {verdict}"),
            "evidence": {"why": format!("because {verdict}"), "failure_recurred": verdict != "confirmed",
                "failure_in_unchanged": true, "loss": loss, "loss_unchanged": null, "spread": 0.0,
                "parts_from_unchanged": {"loss_step": 3, "health": {"step": 10, "kind": "gradient_health",
                    "layer": "fc0", "a": "EXPLODING", "b": "HEALTHY"}}}})
    };
    let steps: Vec<u64> = (0..30).collect();
    let unchanged: Vec<Value> = steps
        .iter()
        .map(|&s| {
            if s < 12 {
                Value::from(2.0)
            } else {
                Value::Null
            }
        })
        .collect();
    let fixed: Vec<f64> = steps.iter().map(|&s| 1.0 / (1.0 + s as f64)).collect();
    let text = serde_json::json!({"format": "neuraldbg-confirm", "version": 1, "model": "Sequential",
        "steps": 30, "verdicts": [verdict(&hyps[0], "refuted", 9.0), verdict(&hyps[1], "confirmed", 0.25)],
        "runs": [{"name": "unchanged re-run", "intervention": null, "steps": steps, "loss": unchanged},
                 {"name": "fix confirmed", "intervention": "fix confirmed", "steps": steps, "loss": fixed}]})
    .to_string();
    let c = Confirmation::from_json(&text).unwrap();
    (e, hyps, c)
}

#[test]
fn confirm_verdicts_lead_the_verdict_with_their_numbers() {
    let (e, hyps, c) = confirmed_run();
    let html = render_html_confirmed(&e, "confirmed", &c);
    let first = html.find(&rich(&hyps[1].description)).unwrap();
    let second = html.find(&rich(&hyps[0].description)).unwrap();
    assert!(first < second, "the confirmed hypothesis is shown first");
    assert!(html.contains(
        "<div class=\"tried confirmed\"><p><b class=\"badge\">CONFIRMED</b> because confirmed</p>"
    ));
    assert!(html.contains("<div class=\"tried refuted\">"));
    assert!(html.contains("0.25 with it, non-finite unchanged"));
    assert!(html.contains(
        "Against the unchanged re-run: the losses part at step 3; health parts at step 10: fc0 \
         gradient_health is EXPLODING unchanged, HEALTHY with the remedy."
    ));
    assert_eq!(c.rank(&hyps)[0].description, hyps[1].description);
    // Without the file the page is the plain report.
    let plain = render_html(&e, "plain");
    assert!(!plain.contains("class=\"tried") && data(&plain)["confirm"].is_null());
}

#[test]
fn confirm_curves_share_the_report_columns_and_keep_non_finite_losses() {
    let (e, _, c) = confirmed_run();
    let d = data(&render_html_confirmed(&e, "confirmed", &c));
    let curves = d["confirm"]["curves"].as_array().unwrap();
    let cols = d["columns"].as_array().unwrap().len();
    assert_eq!(curves.len(), 2);
    assert_eq!(curves[1]["role"], "confirmed");
    assert_eq!(curves[0]["role"], "");
    for curve in curves {
        assert_eq!(curve["last"].as_array().unwrap().len(), cols);
    }
    let at = |curve: &Value, key: &str, step: u64| curve[key][column_of(&d, step)].clone();
    assert_eq!(at(&curves[0], "last", 11), 2.0);
    assert_eq!(at(&curves[0], "max", 12), "NaN");
    assert!(at(&curves[0], "last", 29) == "NaN");
    assert_eq!(at(&curves[1], "last", 3), 0.25);
    // The compact notebook views carry no curves.
    let options = Options {
        sections: Sections::Verdict,
        only: None,
    };
    assert!(data(&render_html_with(&e, "v", &options))["confirm"].is_null());
}

#[test]
fn confirm_files_of_another_kind_or_a_newer_version_are_refused() {
    assert!(Confirmation::from_json("{\"format\": \"other\", \"version\": 1}").is_err());
    let newer = "{\"format\": \"neuraldbg-confirm\", \"version\": 99, \"steps\": 1, \"verdicts\": [], \"runs\": []}";
    assert!(
        Confirmation::from_json(newer)
            .unwrap_err()
            .contains("newer")
    );
    assert_eq!(
        Confirmation::path_for(std::path::Path::new("o/Net.ndbg")),
        std::path::Path::new("o/Net.confirm.json")
    );
}
