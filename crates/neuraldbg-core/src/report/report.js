// Draws the NeuralDBG report from the JSON embedded in the page. No library, no network:
// canvas for the heatmap (one pass over at most MAX_ROWS x MAX_COLUMNS cells), SVG elsewhere.
(function () {
  'use strict';
  const SVG = 'http://www.w3.org/2000/svg';
  const LEFT = 200, RIGHT = 16; // the label gutter is shared so every chart's steps line up
  const COL_NAN = [214, 0, 122], COL_ZERO = [0, 0, 0], COL_EMPTY = [238, 240, 244];
  const RAMPS = {
    vanishing: ['#08306b', '#6baed6'],
    healthy: ['#e5f5e0', '#238b45'],
    saturated: ['#fee08b', '#f46d43'],
    exploding: ['#d73027', '#67001f'],
  };
  const STATE_COLOURS = {
    VANISHING: '#2171b5', EXPLODING: '#cb181d', SATURATED: '#fd8d3c', NON_FINITE: '#d6007a',
    HEALTHY: '#41ab5d', NORMAL: '#41ab5d', FINITE: '#41ab5d', DEAD: '#111111',
    ANOMALOUS: '#8c6bb1', DIVERGING: '#cb181d', PLATEAU: '#807dba', OUT_OF_DISTRIBUTION: '#fd8d3c',
  };
  const LANES = [
    ['gradient_health', 'gradient health'], ['activation_health', 'activation health'],
    ['non_finite_output', 'non-finite output'], ['data_anomaly', 'input data'], ['loss_health', 'loss'],
  ];
  const ROOT_COLOUR = '#c0392b', REFERENCE_COLOUR = '#8a8f99';
  const CURVE_COLOURS = ['#2c7fb8', '#7b3294', '#1b9e77', '#e6ab02', '#d95f02'];
  // Red for the root cause, grey for the healthy reference, distinct hues for the rest.
  function curveColours(series) {
    let next = 0;
    return series.map((s) => s.role === 'root' || s.role === 'feeds root' ? ROOT_COLOUR
      : s.role === 'reference' ? REFERENCE_COLOUR : CURVE_COLOURS[next++ % CURVE_COLOURS.length]);
  }

  const $ = (id) => document.getElementById(id);
  const tooltip = $('tooltip');

  function num(v) {
    if (v === null || v === undefined) return null;
    if (typeof v === 'string') return v === 'NaN' ? NaN : v === 'inf' ? Infinity : -Infinity;
    return v;
  }
  function fmt(v) {
    if (v === null || v === undefined) return '—';
    if (Number.isNaN(v)) return 'NaN';
    if (!Number.isFinite(v)) return v > 0 ? 'inf' : '-inf';
    const a = Math.abs(v);
    if (a === 0) return '0';
    if (a < 1e-3 || a >= 1e4) return v.toExponential(2);
    return String(+v.toPrecision(3));
  }
  function decade(d) {
    return d === 0 ? '1' : d === 1 ? '10' : d === 2 ? '100' : '1e' + d;
  }
  function hex(c) {
    return [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16));
  }
  function mix(a, b, t) {
    t = Math.max(0, Math.min(1, t));
    return [0, 1, 2].map((i) => Math.round(a[i] + (b[i] - a[i]) * t));
  }
  function rgb(c) {
    return 'rgb(' + c.join(',') + ')';
  }
  function el(name, attrs, parent) {
    const e = document.createElementNS(SVG, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function text(parent, x, y, s, attrs) {
    const t = el('text', Object.assign({ x: x, y: y }, attrs || {}), parent);
    t.textContent = s;
    return t;
  }
  // Round tick values over [a, b]; whole numbers only for steps.
  function niceTicks(a, b, n, whole) {
    const span = b - a;
    if (!(span > 0)) return [a];
    const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / mag;
    let step = (m < 1.5 ? 1 : m < 3 ? 2 : m < 7 ? 5 : 10) * mag;
    if (whole) step = Math.max(1, step);
    const out = [];
    for (let i = Math.ceil(a / step - 1e-9); i * step <= b + step * 1e-9; i++) out.push(+(i * step).toPrecision(12));
    return out;
  }
  function showTip(ev, s) {
    tooltip.textContent = s;
    tooltip.style.display = 'block';
    const x = Math.min(ev.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
    tooltip.style.left = x + 'px';
    tooltip.style.top = (ev.clientY + 14) + 'px';
  }
  function hideTip() {
    tooltip.style.display = 'none';
  }
  function ellipsize(ctx, s, width) {
    if (ctx.measureText(s).width <= width) return s;
    let lo = 0;
    while (lo < s.length && ctx.measureText('…' + s.slice(lo)).width > width) lo++;
    return '…' + s.slice(lo);
  }

  function render(D) {
    const T = D.thresholds, H = D.heatmap, cols = D.columns;
    const LV = Math.log10(T.vanishing), LS = Math.log10(T.saturated), LE = Math.log10(T.exploding);
    const LO = H.log_lo, HI = H.log_hi;
    const W = document.querySelector('#heatmap-section .canvas-wrap').clientWidth;
    const PW = Math.max(100, W - LEFT - RIGHT);
    const S0 = cols.length ? cols[0][0] : 0;
    const S1 = cols.length ? cols[cols.length - 1][1] + 1 : 1;
    const xOf = (s) => LEFT + (s - S0) / Math.max(1, S1 - S0) * PW;
    const mid = (c) => xOf((cols[c][0] + cols[c][1] + 1) / 2);
    const focus = D.focus;

    function colourLog(l) {
      const ramp = (name, t) => mix(hex(RAMPS[name][0]), hex(RAMPS[name][1]), t);
      if (l < LV) return ramp('vanishing', (l - LO) / Math.max(1e-9, LV - LO));
      if (l <= LS) return ramp('healthy', (l - LV) / Math.max(1e-9, LS - LV));
      if (l <= LE) return ramp('saturated', (l - LS) / Math.max(1e-9, LE - LS));
      return ramp('exploding', (l - LE) / Math.max(1e-9, HI - LE));
    }
    const dec = (c) => LO + (c - 2) / 251 * (HI - LO);
    // One number per cell orders what a pixel shows when several cells share it:
    // NaN > exploding > zero > vanishing (smallest first) > the rest (largest first).
    function key(minc, maxc) {
      if (minc === 0 && maxc === 0) return -1;
      if (minc === 255 || maxc === 255) return 5000;
      if (maxc >= 2 && dec(maxc) > LE) return 4000 + maxc;
      if (minc === 1) return 3500;
      if (dec(minc) < LV) return 3000 + (255 - minc);
      return 1000 + maxc;
    }
    function keyColour(k) {
      if (k < 0) return COL_EMPTY;
      if (k >= 5000) return COL_NAN;
      if (k >= 4000) return colourLog(dec(k - 4000));
      if (k === 3500) return COL_ZERO;
      if (k >= 3000) return colourLog(dec(255 - (k - 3000)));
      return colourLog(dec(k - 1000));
    }
    function describe(minc, maxc) {
      if (minc === 0 && maxc === 0) return 'no gradient';
      const v = (c) => c === 255 ? 'NaN/Inf' : c === 1 ? '0' : '≈' + fmt(Math.pow(10, dec(c)));
      const k = key(minc, maxc);
      const state = k >= 5000 ? 'NON_FINITE' : k >= 4000 ? 'EXPLODING' : k >= 3000 ? 'VANISHING'
        : dec(maxc) > LS ? 'SATURATED' : 'HEALTHY';
      return 'min ' + v(minc) + ', max ' + v(maxc) + '  →  ' + state;
    }

    // ---------------------------------------------------------------- legend
    (function legend() {
      const host = $('legend');
      host.textContent = '';
      const w = Math.min(640, PW), h = 50, x0 = LEFT;
      const svg = el('svg', { width: x0 + w + 330, height: h, class: 'axis' }, host);
      const n = 240;
      for (let i = 0; i < n; i++) {
        const l = LO + (HI - LO) * (i + 0.5) / n;
        el('rect', { x: x0 + w * i / n, y: 18, width: w / n + 0.6, height: 12, fill: rgb(colourLog(l)) }, svg);
      }
      const xl = (l) => x0 + (l - LO) / (HI - LO) * w;
      const every = Math.max(1, Math.ceil((HI - LO) / 12));
      for (let d = Math.ceil(LO); d <= HI; d++) {
        if (d % every !== 0) continue;
        el('line', { x1: xl(d), x2: xl(d), y1: 30, y2: 34, stroke: '#8a91a0' }, svg);
        text(svg, xl(d), 45, decade(d), { 'text-anchor': 'middle' });
      }
      // Threshold labels sit centred on their mark; neighbours too close are pushed apart
      // (by their measured widths) so that a gap always separates them.
      const GAP = 10;
      const marks = [[LV, 'vanishing <'], [LS, 'saturated >'], [LE, 'exploding >']].map(([l, name]) => {
        const x = xl(l);
        el('line', { x1: x, x2: x, y1: 14, y2: 32, stroke: '#1d2330', 'stroke-width': 1.5 }, svg);
        const label = name + ' ' + decade(Math.round(l));
        const t = text(svg, x, 11, label, { 'text-anchor': 'start', fill: '#1d2330', class: 'threshold' });
        let w = 0;
        try { w = t.getComputedTextLength(); } catch (e) { /* not laid out */ }
        if (!(w > 0)) w = label.length * 7;
        return { t: t, w: w, left: x - w / 2 };
      });
      for (let pass = 0; pass < 2; pass++) {
        for (let i = 1; i < marks.length; i++) {
          const p = marks[i - 1], q = marks[i];
          const overlap = p.left + p.w + GAP - q.left;
          if (overlap > 0) {
            if (pass === 0) { p.left -= overlap / 2; q.left += overlap / 2; } else { q.left += overlap; }
          }
        }
      }
      const shift = Math.max(0, -marks[0].left);
      marks.forEach((m) => m.t.setAttribute('x', m.left + shift));
      text(svg, LEFT - 8, 28, 'gradient norm', { 'text-anchor': 'end' });
      let x = x0 + w + 24;
      [[COL_ZERO, 'exactly 0'], [COL_NAN, 'NaN / Inf'], [COL_EMPTY, 'no gradient']].forEach(([c, name]) => {
        el('rect', { x: x, y: 18, width: 14, height: 12, fill: rgb(c), stroke: '#c3c8d2' }, svg);
        text(svg, x + 19, 28, name, { fill: '#1d2330' });
        x += 100;
      });
    })();

    // ---------------------------------------------------------------- heatmap
    (function heatmap() {
      const canvas = $('heatmap');
      const rows = H.rows.length, ncol = cols.length;
      // Few layers get tall rows, many get at least a pixel until the map is 680 px tall
      // (then several layers share a pixel row, which shows the worst of them).
      const rowPx = rows <= 30 ? 18 : rows <= 80 ? 10 : rows <= 200 ? 4 : 640 / rows;
      const ph = Math.max(150, Math.min(680, Math.round(rows * rowPx)));
      const pw = Math.round(PW), TOP = 20, BOTTOM = 34;
      const dpr = window.devicePixelRatio || 1;
      canvas.style.width = W + 'px';
      canvas.style.height = (TOP + ph + BOTTOM) + 'px';
      canvas.width = Math.round(W * dpr);
      canvas.height = Math.round((TOP + ph + BOTTOM) * dpr);
      const ctx = canvas.getContext('2d');
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, W, TOP + ph + BOTTOM);
      if (!rows || !ncol) {
        ctx.fillStyle = '#5b6375';
        ctx.fillText('no gradient observed', LEFT, TOP + 20);
        return;
      }
      const bin = atob(H.codes);
      const codes = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) codes[i] = bin.charCodeAt(i);
      const colX = new Int32Array(ncol + 1), colX1 = new Int32Array(ncol);
      for (let c = 0; c < ncol; c++) {
        colX[c] = Math.min(pw - 1, Math.floor(xOf(cols[c][0]) - LEFT));
        colX1[c] = Math.min(pw, Math.max(colX[c] + 1, Math.floor(xOf(cols[c][1] + 1) - LEFT)));
      }
      const keys = new Float32Array(pw * ph).fill(-1);
      for (let r = 0; r < rows; r++) {
        const y0 = Math.min(ph - 1, Math.floor(r * ph / rows));
        const y1 = Math.max(y0 + 1, Math.floor((r + 1) * ph / rows));
        for (let c = 0; c < ncol; c++) {
          const i = (r * ncol + c) * 2;
          const k = key(codes[i], codes[i + 1]);
          for (let y = y0; y < y1; y++) {
            const base = y * pw;
            for (let x = colX[c]; x < colX1[c]; x++) if (k > keys[base + x]) keys[base + x] = k;
          }
        }
      }
      const img = ctx.createImageData(pw, ph);
      const cache = new Map();
      for (let p = 0; p < keys.length; p++) {
        let c = cache.get(keys[p]);
        if (!c) { c = keyColour(keys[p]); cache.set(keys[p], c); }
        img.data[4 * p] = c[0]; img.data[4 * p + 1] = c[1]; img.data[4 * p + 2] = c[2]; img.data[4 * p + 3] = 255;
      }
      const off = document.createElement('canvas');
      off.width = pw; off.height = ph;
      off.getContext('2d').putImageData(img, 0, 0);
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(off, LEFT, TOP, pw, ph);
      ctx.strokeStyle = '#c3c8d2';
      ctx.lineWidth = 1;
      ctx.strokeRect(LEFT - 0.5, TOP - 0.5, pw + 1, ph + 1);
      // A lone NaN or spike in a big map is a pixel or two: ring the rare ones so they are seen.
      const rare = [];
      for (let p = 0; p < keys.length && rare.length <= 300; p++) if (keys[p] >= 4000) rare.push(p);
      if (rare.length <= 300) {
        const ringed = new Set();
        rare.forEach((p) => {
          const x = p % pw, y = Math.floor(p / pw), cell = Math.floor(x / 6) + ',' + Math.floor(y / 6);
          if (ringed.has(cell)) return;
          ringed.add(cell);
          ctx.strokeStyle = keys[p] >= 5000 ? rgb(COL_NAN) : '#67001f';
          ctx.lineWidth = 1.5;
          ctx.strokeRect(LEFT + x - 5, TOP + y - 5, 11, 11);
        });
      }

      // Row labels: every row when there is room, else evenly spaced ones; the root always.
      ctx.font = '11px system-ui, "Liberation Sans", sans-serif';
      ctx.textAlign = 'right';
      ctx.textBaseline = 'middle';
      const rowH = ph / rows;
      const every = Math.max(1, Math.ceil(13 / rowH));
      // The root's label: beside its rows, or (an activation, which has no row of its own) on
      // the line between two, kept clear of the axis labels above and below the map.
      let rootY = null;
      if (focus && focus.rows) {
        rootY = Math.min(Math.max(TOP + (focus.rows[0] + focus.rows[1]) / 2 * rowH, TOP + 7), TOP + ph - 7);
        canvas.dataset.rootLabel = String(rootY);
      }
      for (let r = 0; r < rows; r += every) {
        const y = TOP + (r + 0.5) * rowH;
        if (rootY !== null && Math.abs(y - rootY) < 11) continue;
        ctx.fillStyle = '#4a5263';
        ctx.fillText(ellipsize(ctx, H.rows[r].name, LEFT - 14), LEFT - 6, y);
      }
      // X axis.
      ctx.textAlign = 'center';
      ctx.textBaseline = 'top';
      ctx.fillStyle = '#5b6375';
      niceTicks(S0, S1 - 1, 10, true).forEach((t) => {
        const x = xOf(t + 0.5);
        ctx.fillRect(x, TOP + ph + 1, 1, 4);
        ctx.fillText(String(t), x, TOP + ph + 7);
      });
      ctx.textAlign = 'right';
      ctx.fillText('step', LEFT - 6, TOP + ph + 7);
      ctx.fillText('↓ forward order', LEFT - 6, 4);

      // The root cause and the onset, from the top hypothesis.
      if (focus && focus.rows) {
        const y0 = TOP + focus.rows[0] * rowH, y1 = TOP + focus.rows[1] * rowH;
        ctx.strokeStyle = '#111';
        ctx.lineWidth = 2;
        if (y1 - y0 > 0.5) {
          ctx.strokeRect(LEFT - 1, y0 - 1, pw + 2, Math.max(2, y1 - y0) + 2);
        } else {
          ctx.setLineDash([6, 3]);
          ctx.beginPath(); ctx.moveTo(LEFT, y0); ctx.lineTo(LEFT + pw, y0); ctx.stroke();
          ctx.setLineDash([]);
        }
        ctx.font = 'bold 11px system-ui, "Liberation Sans", sans-serif';
        ctx.fillStyle = '#c0392b';
        ctx.textBaseline = 'middle';
        const label = '▶ root ' + (focus.layer === '' ? '<model>' : focus.layer) + (focus.kind ? ' (' + focus.kind + ')' : '');
        ctx.fillText(ellipsize(ctx, label, LEFT - 8), LEFT - 6, rootY);
      }
      if (focus && focus.step !== null && focus.step !== undefined) {
        const x = Math.round(xOf(focus.step)) + 0.5;
        ctx.strokeStyle = '#111';
        ctx.lineWidth = 1.5;
        ctx.setLineDash([5, 3]);
        ctx.beginPath(); ctx.moveTo(x, TOP - 4); ctx.lineTo(x, TOP + ph + 4); ctx.stroke();
        ctx.setLineDash([]);
        ctx.font = 'bold 11px system-ui, "Liberation Sans", sans-serif';
        ctx.fillStyle = '#111';
        ctx.textBaseline = 'top';
        ctx.textAlign = x > LEFT + pw - 120 ? 'right' : 'left';
        ctx.fillText(' onset: step ' + focus.step + ' ', x, 3);
      }
      canvas.onmousemove = (ev) => {
        const b = canvas.getBoundingClientRect();
        const x = ev.clientX - b.left, y = ev.clientY - b.top;
        if (x < LEFT || x >= LEFT + pw || y < TOP || y >= TOP + ph) return hideTip();
        const r = Math.min(rows - 1, Math.floor((y - TOP) / rowH));
        let lo = 0, hi = ncol - 1;
        while (lo < hi) { const m = (lo + hi + 1) >> 1; if (colX[m] <= x - LEFT) lo = m; else hi = m - 1; }
        const i = (r * ncol + lo) * 2;
        const row = H.rows[r];
        showTip(ev, row.name + ' (' + row.kind + (row.layers > 1 ? ', ' + row.layers + ' layers' : '') + ')\n' +
          'steps ' + cols[lo][0] + '–' + cols[lo][1] + '\n' + describe(codes[i], codes[i + 1]));
      };
      canvas.onmouseleave = hideTip;
      canvas.dataset.plot = [LEFT, TOP, pw, ph].join(',');
      canvas.dataset.rows = String(rows);
      canvas.dataset.columns = String(ncol);
    })();

    // ---------------------------------------------------------------- line charts
    function lineChart(host, series, opts) {
      host.textContent = '';
      const h = opts.height, TOP = 10, BOTTOM = 26, ph = h - TOP - BOTTOM;
      // Log charts keep a strip at the bottom for values of exactly 0.
      const ZERO = opts.log && opts.thresholds ? 12 : 0, sh = ph - ZERO;
      const svg = el('svg', { width: W, height: h, class: 'axis' }, host);
      const vals = [];
      series.forEach((s) => ['min', 'max', 'last'].forEach((k) => s[k].forEach((v) => {
        v = num(v);
        if (v !== null && Number.isFinite(v) && (!opts.log || v > 0)) vals.push(v);
      })));
      let lo, hi;
      const f = opts.log ? (v) => Math.log10(v) : (v) => v;
      if (opts.log) {
        // Gradient charts always show the thresholds the norms are judged against.
        const logs = vals.map(f).concat(opts.thresholds ? [LV - 1, LE + 1] : []);
        lo = logs.length ? Math.floor(Math.min(...logs)) : 0;
        hi = logs.length ? Math.ceil(Math.max(...logs)) : 1;
        if (hi === lo) hi += 1;
      } else {
        lo = vals.length ? Math.min(...vals) : 0;
        hi = vals.length ? Math.max(...vals) : 1;
        if (lo > 0 && lo < 0.5 * hi) lo = 0;
        if (hi === lo) { hi += 1; lo -= lo > 0 ? Math.min(lo, 1) : 1; }
      }
      const y = (v) => {
        if (v === null) return null;
        if (opts.log && v <= 0) return TOP + ph - 2;
        return TOP + (hi - f(v)) / (hi - lo) * sh;
      };
      el('rect', { x: LEFT, y: TOP, width: PW, height: ph, fill: 'none', stroke: '#c3c8d2' }, svg);
      if (opts.log) {
        const every = Math.max(1, Math.ceil((hi - lo) / 8));
        for (let d = Math.ceil(lo); d <= hi; d++) {
          if (d % every) continue;
          const yy = TOP + (hi - d) / (hi - lo) * sh;
          el('line', { x1: LEFT, x2: LEFT + PW, y1: yy, y2: yy, stroke: '#eef0f4' }, svg);
          text(svg, LEFT - 6, yy + 4, decade(d), { 'text-anchor': 'end' });
        }
        if (ZERO) text(svg, LEFT - 6, TOP + ph + 2, '0', { 'text-anchor': 'end' });
        (opts.thresholds ? [[LV, 'vanishing'], [LS, 'saturated'], [LE, 'exploding']] : []).forEach(([l, name]) => {
          const yy = TOP + (hi - l) / (hi - lo) * sh;
          el('line', { x1: LEFT, x2: LEFT + PW, y1: yy, y2: yy, stroke: '#1d2330', 'stroke-dasharray': '5 4', 'stroke-width': 1 }, svg);
          text(svg, LEFT + PW - 4, yy - 3, name + ' ' + decade(Math.round(l)), { 'text-anchor': 'end', fill: '#1d2330' });
        });
      } else {
        niceTicks(lo, hi, 4).forEach((t) => {
          const yy = y(t);
          el('line', { x1: LEFT, x2: LEFT + PW, y1: yy, y2: yy, stroke: '#eef0f4' }, svg);
          text(svg, LEFT - 6, yy + 4, fmt(t), { 'text-anchor': 'end' });
        });
      }
      niceTicks(S0, S1 - 1, 10, true).forEach((t) => {
        const x = xOf(t + 0.5);
        el('line', { x1: x, x2: x, y1: TOP + ph, y2: TOP + ph + 4, stroke: '#8a91a0' }, svg);
        text(svg, x, TOP + ph + 16, String(t), { 'text-anchor': 'middle' });
      });
      text(svg, LEFT - 6, TOP + ph + 16, 'step', { 'text-anchor': 'end' });
      if (focus && focus.step !== null && focus.step !== undefined) {
        const x = xOf(focus.step);
        el('line', { x1: x, x2: x, y1: TOP, y2: TOP + ph, stroke: '#111', 'stroke-dasharray': '5 3' }, svg);
      }
      // Drawn last to first, so the first series (the root cause) lies on top.
      series.slice().reverse().forEach((s, ri) => {
        const si = series.length - 1 - ri;
        const colour = opts.colours[si % opts.colours.length];
        const mins = s.min.map(num), maxs = s.max.map(num), lasts = s.last.map(num);
        // Band: min to max over runs of columns that have both.
        let upper = [], lower = [];
        const flush = () => {
          if (upper.length) {
            const d = 'M' + upper.concat(lower.reverse()).map((p) => p[0].toFixed(1) + ',' + p[1].toFixed(1)).join('L') + 'Z';
            el('path', { d: d, fill: colour, 'fill-opacity': 0.16, stroke: 'none' }, svg);
          }
          upper = []; lower = [];
        };
        for (let c = 0; c < cols.length; c++) {
          const a = mins[c], b = maxs[c];
          if (a === null || b === null || !Number.isFinite(b)) { flush(); continue; }
          upper.push([mid(c), y(b)]); lower.push([mid(c), y(a)]);
        }
        flush();
        let d = '', pen = false;
        for (let c = 0; c < cols.length; c++) {
          const v = lasts[c];
          if (v === null || !Number.isFinite(v)) { pen = false; continue; }
          d += (pen ? 'L' : 'M') + mid(c).toFixed(1) + ',' + y(v).toFixed(1);
          pen = true;
        }
        el('path', { d: d, fill: 'none', stroke: colour, 'stroke-width': opts.emphasise && (s.role === 'root' || s.role === 'feeds root') ? 2.2 : 1.5,
          'stroke-dasharray': s.role === 'reference' ? '4 3' : 'none' }, svg);
        for (let c = 0; c < cols.length; c++) {
          if (maxs[c] !== null && Number.isNaN(maxs[c])) {
            const x = mid(c);
            el('path', { d: 'M' + (x - 4) + ',' + (TOP + 1) + 'L' + (x + 4) + ',' + (TOP + 1) + 'L' + x + ',' + (TOP + 8) + 'Z',
              fill: rgb(COL_NAN), stroke: colour, 'stroke-width': 0.8 }, svg);
          }
        }
      });
      svg.onmousemove = (ev) => {
        const b = svg.getBoundingClientRect();
        const x = ev.clientX - b.left;
        if (x < LEFT || x > LEFT + PW || !cols.length) return hideTip();
        let c = 0;
        while (c < cols.length - 1 && xOf(cols[c][1] + 1) < x) c++;
        showTip(ev, 'steps ' + cols[c][0] + '–' + cols[c][1] + '\n' + series.map((s) =>
          s.name + ': ' + fmt(num(s.last[c])) + '  (min ' + fmt(num(s.min[c])) + ', max ' + fmt(num(s.max[c])) + ')').join('\n'));
      };
      svg.onmouseleave = hideTip;
      if (opts.chips) {
        const chips = document.createElement('div');
        chips.className = 'chips';
        series.forEach((s, si) => {
          const chip = document.createElement('span');
          chip.className = 'chip';
          const sw = document.createElement('i');
          sw.style.background = opts.colours[si % opts.colours.length];
          chip.appendChild(sw);
          chip.appendChild(document.createTextNode(s.name + (s.role ? ' — ' + s.role : '')));
          chips.appendChild(chip);
        });
        host.appendChild(chips);
      }
    }

    if (D.curves.length) {
      lineChart($('curves'), D.curves, { height: 300, log: true, thresholds: true, colours: curveColours(D.curves), chips: true, emphasise: true });
    } else {
      $('curves').textContent = 'No layer gradient was observed.';
    }
    if (D.loss) {
      const pos = D.loss.min.map(num).filter((v) => v !== null && Number.isFinite(v));
      const logLoss = pos.length > 0 && pos.every((v) => v > 0) && Math.max(...pos) / Math.min(...pos) > 100;
      lineChart($('loss'), [D.loss], { height: 150, log: logLoss, thresholds: false, colours: ['#34495e'], chips: false });
    } else {
      $('loss-wrap').style.display = 'none';
    }
    if (D.confirm && D.confirm.curves.length) {
      const pos = [].concat(...D.confirm.curves.map((c) => c.min.map(num))).filter((v) => v !== null && Number.isFinite(v));
      const logLoss = pos.length > 0 && pos.every((v) => v > 0) && Math.max(...pos) / Math.min(...pos) > 100;
      lineChart($('confirm'), D.confirm.curves, { height: 220, log: logLoss, thresholds: false,
        colours: ['#34495e', '#8a91a0', '#1f9e89', '#e67e22', '#8e44ad', '#c0392b', '#2980b9'], chips: true });
    } else {
      $('confirm-section').style.display = 'none';
    }

    // ---------------------------------------------------------------- timeline
    (function timeline() {
      const host = $('timeline');
      host.textContent = '';
      const lanes = LANES.filter(([k]) => D.events.some((e) => e.kind === k));
      if (!lanes.length) { host.textContent = 'No events: every watched signal stayed in its state.'; return; }
      const laneH = 26, TOP = 6, ph = lanes.length * laneH, h = TOP + ph + 26;
      const svg = el('svg', { width: W, height: h, class: 'axis' }, host);
      lanes.forEach(([k, name], i) => {
        const y = TOP + i * laneH;
        el('rect', { x: LEFT, y: y, width: PW, height: laneH - 2, fill: i % 2 ? '#f8f9fb' : '#f1f3f6' }, svg);
        text(svg, LEFT - 6, y + laneH / 2 + 3, name, { 'text-anchor': 'end' });
      });
      const seen = new Set();
      D.events.forEach((e) => {
        const i = lanes.findIndex(([k]) => k === e.kind);
        const x = xOf(e.step + 0.5);
        const r = el('rect', { x: x - 1.5, y: TOP + i * laneH + 3, width: 3, height: laneH - 8,
          fill: STATE_COLOURS[e.to] || '#555' }, svg);
        el('title', {}, r).textContent = 'step ' + e.step + ' · ' + e.who + ': ' + e.from + ' → ' + e.to +
          ' (value ' + fmt(num(e.value)) + ', confidence ' + fmt(num(e.confidence)) + ')';
        seen.add(e.to);
      });
      if (focus && focus.step !== null && focus.step !== undefined) {
        const x = xOf(focus.step);
        el('line', { x1: x, x2: x, y1: TOP, y2: TOP + ph, stroke: '#111', 'stroke-dasharray': '5 3' }, svg);
      }
      niceTicks(S0, S1 - 1, 10, true).forEach((t) => {
        const x = xOf(t + 0.5);
        text(svg, x, TOP + ph + 16, String(t), { 'text-anchor': 'middle' });
      });
      text(svg, LEFT - 6, TOP + ph + 16, 'step', { 'text-anchor': 'end' });
      const chips = document.createElement('div');
      chips.className = 'chips';
      Array.from(seen).sort().forEach((s) => {
        const chip = document.createElement('span');
        chip.className = 'chip';
        const sw = document.createElement('i');
        sw.style.background = STATE_COLOURS[s] || '#555';
        sw.style.height = '10px'; sw.style.width = '4px';
        chip.appendChild(sw);
        chip.appendChild(document.createTextNode('→ ' + s));
        chips.appendChild(chip);
      });
      const note = document.createElement('span');
      note.className = 'chip';
      note.textContent = D.events.length + ' of ' + D.events_total + ' events shown' +
        (D.events_suppressed ? ', ' + D.events_suppressed + ' more suppressed by the per-layer cap' : '');
      chips.appendChild(note);
      host.appendChild(chips);
      const tbody = document.querySelector('#events tbody');
      tbody.textContent = '';
      const frag = document.createDocumentFragment();
      D.events.forEach((e) => {
        const tr = document.createElement('tr');
        [e.step, e.kind, e.who, e.from + ' → ' + e.to, fmt(num(e.value)), fmt(num(e.confidence))].forEach((v) => {
          const td = document.createElement('td');
          td.textContent = String(v);
          tr.appendChild(td);
        });
        frag.appendChild(tr);
      });
      tbody.appendChild(frag);
    })();

    // ---------------------------------------------------------------- causal graph
    (function graph() {
      const host = $('graph');
      host.textContent = '';
      if (!D.graph.length) { host.textContent = 'No failure to explain.'; return; }
      const BW = 270, BH = 50, GAP = 60, ROW = BH + 14;
      const rowsOf = (g) => Math.max(1, g.consequences.length);
      const h = D.graph.reduce((a, g) => a + rowsOf(g) * ROW + 16, 0);
      const svg = el('svg', { width: Math.min(W, 3 * BW + 2 * GAP + 20), height: h }, host);
      const defs = el('defs', {}, svg);
      const marker = el('marker', { id: 'arrow', viewBox: '0 0 10 10', refX: 10, refY: 5, markerWidth: 7, markerHeight: 7, orient: 'auto' }, defs);
      el('path', { d: 'M0,0L10,5L0,10Z', fill: '#5b6375' }, marker);
      const box = (x, y, fill, stroke, caption, line1, line2) => {
        el('rect', { x: x, y: y, width: BW, height: BH, rx: 6, fill: fill, stroke: stroke }, svg);
        text(svg, x + 10, y + 14, caption, { fill: '#5b6375', 'font-size': 10.5 });
        text(svg, x + 10, y + 30, line1, { fill: '#1d2330', 'font-size': 13, 'font-weight': 600 });
        if (line2) text(svg, x + 10, y + 44, line2, { fill: '#4a5263', 'font-size': 11 });
      };
      const arrow = (x1, y1, x2, y2) => el('path', {
        d: 'M' + x1 + ',' + y1 + 'C' + (x1 + GAP / 2) + ',' + y1 + ' ' + (x2 - GAP / 2) + ',' + y2 + ' ' + x2 + ',' + y2,
        fill: 'none', stroke: '#5b6375', 'stroke-width': 1.4, 'marker-end': 'url(#arrow)' }, svg);
      let y = 4;
      D.graph.forEach((g) => {
        const n = rowsOf(g), cy = y + (n * ROW - 14) / 2 - BH / 2;
        box(2, cy, '#eaf2fb', '#9ec3e6', 'cause (confidence ' + g.confidence.toFixed(2) + ')', g.cause, null);
        const where = (g.layer !== null ? 'in ' + g.layer + ', ' : '') + 'from step ' + g.step +
          (g.affected > 1 ? ' · ' + g.affected + ' modules' : '');
        box(2 + BW + GAP, cy, '#fdecea', '#e6a39b', 'root failure', g.failure, where);
        arrow(2 + BW, cy + BH / 2, 2 + BW + GAP, cy + BH / 2);
        g.consequences.forEach((c, i) => {
          const yy = y + i * ROW;
          box(2 + 2 * (BW + GAP), yy, '#fff4e5', '#f0c27b', 'then', c, null);
          arrow(2 + 2 * BW + GAP, cy + BH / 2, 2 + 2 * (BW + GAP), yy + BH / 2);
        });
        y += n * ROW + 16;
      });
      D.graph.forEach((g) => {
        if (!g.chain.length) return;
        const h4 = document.createElement('h4');
        h4.className = 'chain-title';
        h4.textContent = 'How ' + g.failure + ' unfolded (cause: ' + g.cause + ')';
        host.appendChild(h4);
        const ol = document.createElement('ol');
        ol.className = 'chain';
        g.chain.forEach((line) => {
          const li = document.createElement('li');
          li.textContent = line.replace(/`/g, '');
          ol.appendChild(li);
        });
        host.appendChild(ol);
      });
    })();
    document.querySelector('#mermaid pre').textContent = D.mermaid;
  }

  function start() {
    const body = document.body;
    try {
      const D = JSON.parse($('ndbg-data').textContent);
      if (D === null) {
        document.querySelectorAll('section.chart').forEach((s) => { s.style.display = 'none'; });
      } else {
        render(D);
        let pending = 0;
        window.addEventListener('resize', () => {
          clearTimeout(pending);
          pending = setTimeout(() => render(D), 150);
        });
      }
      body.dataset.rendered = 'ok';
    } catch (e) {
      body.dataset.rendered = 'error';
      const p = document.createElement('p');
      p.className = 'render-error';
      p.textContent = 'The charts could not be drawn: ' + e;
      $('report').insertBefore(p, $('report').firstChild);
    }
  }
  start();
})();
