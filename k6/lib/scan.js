// Shared request logic for k6/scan.js, k6/arrival.js and k6/closed.js.
//
// One iteration = one scan: POST /api/v1/scan/classify/completion, wait for the whole
// text/event-stream body (k6 has no SSE client; http.post returns when the stream
// ends), parse the events and record them in the custom metrics below.
//
// Environment (all optional):
//   BASE_URL         service URL (default http://127.0.0.1:8000)
//   BASE_URLS        several replicas' URLs, comma-separated: scans go to each in turn
//   FORM             json | multipart | mixed (alternate per iteration), default json
//   IMAGE_SET        big (4032x3024, ~3.5 MB) | small (1280x960, ~0.35 MB) | tiny (320x240),
//                    default big
//   IMAGES_DIR       where make_images.py wrote the images (default k6/images; until that
//                    exists, the committed k6/sample-images, i.e. the tiny set)
//   REQ_TIMEOUT      per-request timeout, default 120s
//   RETRY_AFTER_MAX  upper bound in seconds for the Retry-After sleep after a 429/503
//                    (default 10, arrival.js 0; 0 = don't sleep)
//   THINK            seconds to sleep after each completed scan (default 0)
//   USER_PREFIX      X-User-ID prefix (default "vu-"; each VU is its own user)
//   SUMMARY_JSON     write the raw end-of-test summary as JSON to this path
//   STAGE_NAMES      the service's stages, comma-separated: a stage_<name>_ms trend each.
//                    The Python tools pass app/stages/order.py's list (sweep/k6_run.py,
//                    stage_env); k6 declares metrics only in the init context, which can
//                    make no request, so neither the stream nor /openapi.json can say.
//
// Memory: open() copies data into every VU, so each VU loads ONE image of the set
// (rotating over the set by VU number) and pre-builds its request body once. That keeps
// a 2000-VU run with IMAGE_SET=small at ~1 MB per VU instead of the whole set per VU.

import http from 'k6/http';
import encoding from 'k6/encoding';
import { check, sleep } from 'k6';
import { Counter, Rate, Trend } from 'k6/metrics';

export const BASE_URL = (__ENV.BASE_URL || 'http://127.0.0.1:8000').replace(/\/+$/, '');
export const SCAN_URL = `${BASE_URL}/api/v1/scan/classify/completion`;
// BASE_URLS (comma-separated) spreads the scans over several replicas, turn by turn per
// iteration, as a round-robin balancer would (k6/budget_bench.py --replicas).
const SCAN_URLS = (__ENV.BASE_URLS || BASE_URL)
  .split(',')
  .map((url) => `${url.trim().replace(/\/+$/, '')}/api/v1/scan/classify/completion`);

function scanUrl() {
  return SCAN_URLS[(__VU + __ITER) % SCAN_URLS.length];
}
export const FORM = (__ENV.FORM || 'json').toLowerCase();
export const IMAGE_SET = (__ENV.IMAGE_SET || 'big').toLowerCase();
export const REQ_TIMEOUT = __ENV.REQ_TIMEOUT || '120s';
const RETRY_AFTER_MAX = envNumber('RETRY_AFTER_MAX', null); // null: the script's default
const THINK = envNumber('THINK', 0);
const USER_PREFIX = __ENV.USER_PREFIX || 'vu-';

if (!['json', 'multipart', 'mixed'].includes(FORM)) {
  throw new Error(`FORM must be json, multipart or mixed, got ${FORM}`);
}
if (!['big', 'small', 'tiny'].includes(IMAGE_SET)) {
  throw new Error(`IMAGE_SET must be big, small or tiny, got ${IMAGE_SET}`);
}

// --- metrics ---------------------------------------------------------------------------
const sseTtfb = new Trend('sse_ttfb', true);
const sseTotal = new Trend('sse_total_duration', true);
export const STAGE_NAMES = (__ENV.STAGE_NAMES || '')
  .split(',')
  .map((name) => name.trim())
  .filter((name) => name !== '');
// Said at the start and in the summary: a run by hand without STAGE_NAMES has no stage trends.
export const STAGES_NOTE = STAGE_NAMES.length
  ? ''
  : 'STAGE_NAMES is not set: no stage_<name>_ms trends (the Python tools set it; by hand: ' +
    'STAGE_NAMES=$(.venv/bin/python -c \'from app.stages.order import stage_names; ' +
    'print(",".join(stage_names()))\'))';
// The `done` event's timings: prepare_ms (before any stage), one per stage, total_ms.
const stageTrends = { prepare_ms: new Trend('stage_prepare_ms', true) };
for (const name of STAGE_NAMES) stageTrends[`${name}_ms`] = new Trend(`stage_${name}_ms`, true);
const TIMING_KEYS = [...Object.keys(stageTrends), 'total_ms'].sort().join(',');
const scanSuccess = new Rate('scan_success');
const scanRejected = new Counter('scan_rejected');
const scanErrors = new Counter('scan_errors');
const scanCompleted = new Counter('scan_completed');
const scanHttpErrors = new Counter('scan_http_errors'); // non-200, non-rejection answers (0 = timeout/reset)
const sseDeltas = new Counter('sse_deltas');

// 429 and 503 are the service shedding load as designed: not failures.
http.setResponseCallback(http.expectedStatuses(200, 429, 503));

// --- shared options pieces ---------------------------------------------------------------
export const THRESHOLDS = {
  http_req_failed: ['rate<0.3'],
  sse_total_duration: ['p(95)<30000'],
  sse_ttfb: ['p(95)<8000'],
};

export const SUMMARY_TREND_STATS = ['avg', 'min', 'med', 'max', 'p(90)', 'p(95)', 'p(99)', 'count'];

// --- images and request bodies (init context, once per VU) -----------------------------------
// open() paths are relative to this file. The generated set (k6/make_images.py) is
// gitignored; until it exists, every IMAGE_SET sends the committed samples (the four
// 320x240 tiny images), so the scripts run right after install.
const GENERATED_DIR = '../images';
const SAMPLES_DIR = '../sample-images';
const ALL_USER_INPUTS = [
  '이거 어떻게 버려요?',
  '뚜껑이랑 라벨은 따로 분리해야 하나요?',
  '음식물이 조금 묻어 있는데 재활용 되나요?',
  '',
  'How do I dispose of this?',
];
// USER_INPUT_LANG=ko or en: only the notes in that language (a limiter may count Korean
// and English differently from our estimate: k6/budget_bench.py --language).
const USER_INPUTS = {
  ko: ALL_USER_INPUTS.slice(0, 3),
  en: ['How do I dispose of this?', 'Should the cap and the label be separated first?'],
}[__ENV.USER_INPUT_LANG || ''] || ALL_USER_INPUTS;

function readManifest(dir) {
  return JSON.parse(open(`${dir}/manifest.json`));
}

function chooseImages() {
  if (__ENV.IMAGES_DIR) {
    const dir = __ENV.IMAGES_DIR.replace(/\/+$/, '');
    try {
      return { dir, list: readManifest(dir)[IMAGE_SET], note: '' };
    } catch (e) {
      throw new Error(`cannot read ${dir}/manifest.json (run: python k6/make_images.py): ${e}`);
    }
  }
  let generated;
  try {
    generated = readManifest(GENERATED_DIR);
  } catch (_e) {
    return { dir: SAMPLES_DIR, list: readManifest(SAMPLES_DIR).tiny, note: samplesNote() };
  }
  return { dir: GENERATED_DIR, list: generated[IMAGE_SET], note: '' };
}

function samplesNote() {
  if (IMAGE_SET === 'tiny') return ''; // the samples are the tiny set
  return (
    `IMAGE_SET=${IMAGE_SET}, but k6/images/ is not generated (python k6/make_images.py): ` +
    'sending the committed 320x240 samples instead'
  );
}

const images = chooseImages();
const IMAGES_DIR = images.dir;
const imageList = images.list;
// Empty unless the images sent are not the IMAGE_SET asked for; setup() and the summary say so.
export const IMAGES_NOTE = images.note;
if (!imageList || imageList.length === 0) {
  const hint = `python k6/make_images.py --sets ${IMAGE_SET}`;
  throw new Error(`${IMAGES_DIR}/manifest.json has no "${IMAGE_SET}" images (run: ${hint})`);
}
// k6 only lets a VU open() files that were opened while it first parsed the script
// (__VU == 0), so that pass registers the whole set; real VUs then keep one image each.
if (__VU === 0) {
  for (const entry of imageList) open(`${IMAGES_DIR}/${entry.file}`, 'b');
}
const vuIndex = __VU > 0 ? __VU - 1 : 0;
const image = imageList[vuIndex % imageList.length];
const userInput = USER_INPUTS[vuIndex % USER_INPUTS.length];
// Keep only what this run's FORM needs: the raw bytes for multipart, the JSON body
// (with the base64 data URL inside) for json; both for mixed.
function buildPayloads() {
  if (__VU === 0) return { bytes: null, json: null };
  const bytes = open(`${IMAGES_DIR}/${image.file}`, 'b');
  const json =
    FORM === 'multipart'
      ? null
      : JSON.stringify({
          image_url: `data:image/jpeg;base64,${encoding.b64encode(bytes)}`,
          user_input: userInput,
        });
  return { bytes: FORM === 'json' ? null : bytes, json };
}
const payloads = buildPayloads();

function envNumber(name, fallback) {
  const raw = __ENV[name];
  if (raw === undefined || raw === '') return fallback;
  const value = Number(raw);
  if (!Number.isFinite(value)) throw new Error(`${name} must be a number, got ${raw}`);
  return value;
}

// --- SSE parsing -------------------------------------------------------------------------------
// Events are separated by a blank line; within one, `event:` names it and `data:` lines
// (joined by "\n") carry the payload. Lines starting with ":" are comments (pings).
export function parseSse(body) {
  const events = [];
  if (!body) return events;
  const blocks = String(body).replace(/\r\n?/g, '\n').split(/\n\n+/);
  for (const block of blocks) {
    let name = 'message';
    const data = [];
    for (const line of block.split('\n')) {
      if (line === '' || line.startsWith(':')) continue;
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? '' : line.slice(colon + 1);
      if (value.startsWith(' ')) value = value.slice(1);
      if (field === 'event') name = value;
      else if (field === 'data') data.push(value);
    }
    if (data.length === 0) continue;
    let parsed = null;
    try {
      parsed = JSON.parse(data.join('\n'));
    } catch (_e) {
      parsed = { raw: data.join('\n') };
    }
    events.push({ event: name, data: parsed });
  }
  return events;
}

// --- one scan ------------------------------------------------------------------------------------
function formFor(iteration) {
  if (FORM !== 'mixed') return FORM;
  return (iteration + __VU) % 2 === 0 ? 'json' : 'multipart';
}

function send(form) {
  const params = {
    headers: { 'X-User-ID': `${USER_PREFIX}${__VU}`, Accept: 'text/event-stream' },
    timeout: REQ_TIMEOUT,
    tags: { name: 'scan', form, image_set: IMAGE_SET },
    responseType: 'text',
  };
  if (form === 'json') {
    params.headers['Content-Type'] = 'application/json';
    return http.post(scanUrl(), payloads.json, params);
  }
  const payload = {
    image: http.file(payloads.bytes, image.file, 'image/jpeg'),
    user_input: userInput,
  };
  return http.post(scanUrl(), payload, params);
}

function retryAfterSeconds(res) {
  const raw = res.headers['Retry-After'] || res.headers['retry-after'];
  const seconds = Number(raw);
  return Number.isFinite(seconds) && seconds > 0 ? seconds : 1;
}

function rejectionCode(res) {
  try {
    return JSON.parse(res.body).code || 'UNKNOWN';
  } catch (_e) {
    return 'UNKNOWN';
  }
}

// Returns a short outcome string: completed | error | rejected | http_error.
// `defaults.retryAfterMax` is the script's default bound for the Retry-After sleep
// (RETRY_AFTER_MAX in the environment wins).
export function scanOnce(defaults = {}) {
  const retryAfterMax = RETRY_AFTER_MAX ?? defaults.retryAfterMax ?? 10;
  const form = formFor(__ITER);
  const res = send(form);

  if (res.status === 429 || res.status === 503) {
    scanRejected.add(1, { status: String(res.status), code: rejectionCode(res) });
    if (retryAfterMax > 0) {
      // Jitter below the server's hint so rejected VUs don't come back in lockstep.
      const wait = Math.min(retryAfterSeconds(res), retryAfterMax);
      sleep(wait * (0.5 + Math.random() * 0.5));
    }
    return 'rejected';
  }

  if (res.status !== 200) {
    scanHttpErrors.add(1, { status: String(res.status) });
    if (res.status === 0) sleep(0.2); // a replica that is gone: don't spin on refused connects
    scanSuccess.add(false, { form });
    check(res, { 'scan answered 200': () => false });
    return 'http_error';
  }

  sseTtfb.add(res.timings.waiting, { form });
  sseTotal.add(res.timings.duration, { form });

  const events = parseSse(res.body);
  let done = null;
  let error = null;
  let deltas = 0;
  for (const ev of events) {
    if (ev.event === 'done') done = ev.data;
    else if (ev.event === 'error') error = ev.data;
    else if (ev.event === 'delta') deltas += 1;
  }
  sseDeltas.add(deltas);

  if (error) {
    scanErrors.add(1, { code: String(error.code || 'UNKNOWN'), step: String(error.step || '') });
  }
  if (done && !error) {
    scanCompleted.add(1);
    const timings = done.timings || {};
    for (const key of Object.keys(stageTrends)) {
      if (typeof timings[key] === 'number') stageTrends[key].add(timings[key]);
    }
  }
  const ok = Boolean(done) && !error;
  scanSuccess.add(ok, { form });
  check(res, {
    'scan answered 200': () => true,
    'stream ended with done': () => ok,
  });
  if (ok && STAGE_NAMES.length) {
    // A service whose stages are not STAGE_NAMES would leave trends empty or uncounted.
    const keys = Object.keys(done.timings || {}).sort().join(',');
    check(res, { 'done timings are the STAGE_NAMES stages': () => keys === TIMING_KEYS });
  }
  if (ok && THINK > 0) sleep(THINK);
  return ok ? 'completed' : 'error';
}

// Fail fast (before any VU starts) when the service is not up.
export function checkReady() {
  const res = http.get(`${BASE_URL}/readyz`, { tags: { name: 'readyz' }, timeout: '10s' });
  if (res.status !== 200) {
    throw new Error(`${BASE_URL}/readyz answered ${res.status}: is the service running?`);
  }
  if (IMAGES_NOTE) console.warn(IMAGES_NOTE);
  if (STAGES_NOTE) console.warn(STAGES_NOTE);
  return { baseUrl: BASE_URL, form: FORM, imageSet: IMAGE_SET };
}
