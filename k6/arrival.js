// Open model: RATE new scans per second for DURATION, whatever the service's latency.
// In a closed loop a slow service slows the load generator down with it (each VU waits
// for its answer before sending the next request), which hides latency; here arrivals
// are fixed, so slowness shows up as latency, more VUs in use, and `dropped_iterations`
// once MAX_VUS are all busy.
//
//   RATE=2 DURATION=30s IMAGE_SET=small .venv/bin/k6 run k6/arrival.js
//   RATE=10 DURATION=2m PRE_VUS=50 MAX_VUS=400 .venv/bin/k6 run k6/arrival.js
//
// Env: RATE (scans/s, 5), DURATION (60s), PRE_VUS (RATE * 4), MAX_VUS (RATE * 40),
// GRACEFUL (30s); RETRY_AFTER_MAX defaults to 0 here: an arrival process does not back
// off, and a VU sleeping on Retry-After would only tie up the VU pool. Plus everything
// k6/lib/scan.js reads (BASE_URL, FORM, IMAGE_SET, SUMMARY_JSON...).

import { SUMMARY_TREND_STATS, THRESHOLDS, checkReady, scanOnce } from './lib/scan.js';

export { handleSummary } from './lib/summary.js';

const RATE = parseFloat(__ENV.RATE || '5');
// constant-arrival-rate wants an integer rate: express fractional rates per minute.
const perSecond = Number.isInteger(RATE);

export const options = {
  scenarios: {
    arrival: {
      executor: 'constant-arrival-rate',
      rate: perSecond ? RATE : Math.round(RATE * 60),
      timeUnit: perSecond ? '1s' : '1m',
      duration: __ENV.DURATION || '60s',
      preAllocatedVUs: parseInt(__ENV.PRE_VUS || String(Math.max(2, Math.ceil(RATE * 4))), 10),
      maxVUs: parseInt(__ENV.MAX_VUS || String(Math.max(10, Math.ceil(RATE * 40))), 10),
      gracefulStop: __ENV.GRACEFUL || '30s',
    },
  },
  thresholds: THRESHOLDS,
  summaryTrendStats: SUMMARY_TREND_STATS,
  discardResponseBodies: false,
};

export function setup() {
  return checkReady();
}

export default function () {
  scanOnce({ retryAfterMax: 0 });
}
