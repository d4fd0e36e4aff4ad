// End-of-test summary for the ecoscan k6 scripts.
//
// Exporting handleSummary() replaces k6's built-in text summary, and the official
// textSummary() helper lives on jslib.k6.io (a network import). So this module renders
// its own compact text summary for stdout and, when SUMMARY_JSON is set, writes k6's
// raw summary object (plus an `ecoscan` block with the run's settings) to that path.

import { IMAGES_NOTE, STAGE_NAMES, STAGES_NOTE } from './scan.js';

const ENV_KEYS = [
  'BASE_URL',
  'FORM',
  'IMAGE_SET',
  'VUS',
  'RATE',
  'DURATION',
  'RAMP_UP',
  'HOLD',
  'RAMP_DOWN',
  'STAGES',
  'PRE_VUS',
  'MAX_VUS',
  'REQ_TIMEOUT',
  'RETRY_AFTER_MAX',
  'THINK',
];

const TREND_ORDER = [
  'sse_ttfb',
  'sse_total_duration',
  'stage_prepare_ms',
  ...STAGE_NAMES.map((name) => `stage_${name}_ms`),
  'http_req_duration',
  'http_req_waiting',
  'iteration_duration',
];

const COUNT_ORDER = [
  'scan_completed',
  'scan_rejected',
  'scan_errors',
  'scan_http_errors',
  'scan_success',
  'http_req_failed',
  'http_reqs',
  'iterations',
  'dropped_iterations',
  'checks',
  'data_sent',
  'data_received',
  'vus_max',
];

export function handleSummary(data) {
  const settings = {};
  for (const key of ENV_KEYS) {
    if (__ENV[key] !== undefined) settings[key] = __ENV[key];
  }
  data.ecoscan = { settings, imagesNote: IMAGES_NOTE, stagesNote: STAGES_NOTE };
  const out = { stdout: textSummary(data) };
  if (__ENV.SUMMARY_JSON) out[__ENV.SUMMARY_JSON] = JSON.stringify(data, null, 1);
  return out;
}

function fmtMs(v) {
  if (v === undefined || v === null || !Number.isFinite(v)) return '-';
  if (v >= 10000) return `${(v / 1000).toFixed(1)}s`;
  if (v >= 1000) return `${(v / 1000).toFixed(2)}s`;
  if (v >= 10) return `${v.toFixed(0)}ms`;
  return `${v.toFixed(1)}ms`;
}

function fmtBytes(v) {
  if (v >= 1 << 30) return `${(v / (1 << 30)).toFixed(2)} GiB`;
  if (v >= 1 << 20) return `${(v / (1 << 20)).toFixed(1)} MiB`;
  if (v >= 1 << 10) return `${(v / (1 << 10)).toFixed(1)} KiB`;
  return `${v} B`;
}

function pad(text, width) {
  const s = String(text);
  return s.length >= width ? s : s + ' '.repeat(width - s.length);
}

function lpad(text, width) {
  const s = String(text);
  return s.length >= width ? s : ' '.repeat(width - s.length) + s;
}

function thresholdLines(metrics) {
  const lines = [];
  for (const name of Object.keys(metrics).sort()) {
    const th = metrics[name].thresholds;
    if (!th) continue;
    for (const expr of Object.keys(th)) {
      const m = metrics[name];
      const stat = expr.split(/[<>=!]/)[0].trim();
      let shown = m.values[stat];
      if (m.type === 'trend' && m.contains === 'time') shown = fmtMs(shown);
      else if (m.type === 'rate') shown = `${((shown || 0) * 100).toFixed(2)}%`;
      lines.push(`    ${th[expr].ok ? 'ok  ' : 'FAIL'} ${pad(name, 22)} ${pad(expr, 16)} ${stat}=${shown}`);
    }
  }
  return lines;
}

function trendLines(metrics) {
  const stats = ['avg', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'];
  const lines = [`    ${pad('', 22)}${stats.map((s) => lpad(s, 9)).join('')}${lpad('count', 8)}`];
  const names = TREND_ORDER.filter((n) => metrics[n]).concat(
    Object.keys(metrics)
      .filter((n) => metrics[n].type === 'trend' && !TREND_ORDER.includes(n) && !n.includes('{'))
      .filter((n) => !n.startsWith('http_req_') || n === 'http_req_duration')
      .sort(),
  );
  for (const name of names) {
    const m = metrics[name];
    if (m.type !== 'trend') continue;
    const v = m.values;
    const cells = stats.map((s) => lpad(m.contains === 'time' ? fmtMs(v[s]) : (v[s] ?? 0).toFixed(1), 9));
    const count = v.count === undefined ? '' : v.count;
    lines.push(`    ${pad(name, 22)}${cells.join('')}${lpad(count, 8)}`);
  }
  return lines;
}

function countLines(metrics) {
  const lines = [];
  for (const name of COUNT_ORDER) {
    const m = metrics[name];
    if (!m) continue;
    const v = m.values;
    let text;
    if (m.type === 'counter') {
      const total = m.contains === 'data' ? fmtBytes(v.count) : v.count;
      text = `${total}  (${(v.rate || 0).toFixed(2)}/s)`;
    } else if (m.type === 'rate') {
      text = `${((v.rate || 0) * 100).toFixed(2)}%  (${v.passes} of ${v.passes + v.fails})`;
    } else {
      text = `${v.value ?? v.max}`;
    }
    lines.push(`    ${pad(name, 22)} ${text}`);
  }
  return lines;
}

function checkLines(group) {
  const lines = [];
  for (const c of (group && group.checks) || []) {
    lines.push(`    ${c.fails === 0 ? 'ok  ' : 'FAIL'} ${c.name}: ${c.passes} passed, ${c.fails} failed`);
  }
  for (const g of (group && group.groups) || []) lines.push(...checkLines(g));
  return lines;
}

export function textSummary(data) {
  const metrics = data.metrics || {};
  const seconds = ((data.state && data.state.testRunDurationMs) || 0) / 1000;
  const s = data.ecoscan ? data.ecoscan.settings : {};
  const shown = ENV_KEYS.filter((k) => k !== 'BASE_URL' && s[k] !== undefined)
    .map((k) => `${k}=${s[k]}`)
    .join(' ');
  const lines = ['', `  ecoscan k6 summary: ${seconds.toFixed(1)}s against ${s.BASE_URL || '(default)'}`];
  if (shown) lines.push(`  ${shown}`);
  if (data.ecoscan && data.ecoscan.imagesNote) lines.push(`  ${data.ecoscan.imagesNote}`);
  if (data.ecoscan && data.ecoscan.stagesNote) lines.push(`  ${data.ecoscan.stagesNote}`);
  const th = thresholdLines(metrics);
  if (th.length) lines.push('', '  THRESHOLDS', ...th);
  lines.push('', '  LATENCY', ...trendLines(metrics));
  lines.push('', '  COUNTS', ...countLines(metrics));
  const checks = checkLines(data.root_group);
  if (checks.length) lines.push('', '  CHECKS', ...checks);
  lines.push('', '');
  return lines.join('\n');
}
