// Closed loop: VUS virtual users, each sending its next scan as soon as the last one
// ends, for DURATION. Use it for "N concurrent scans held" tests (e.g. VUS=500 or 2000
// with IMAGE_SET=small; every VU holds its image and body in memory).
//
//   VUS=5 DURATION=10s IMAGE_SET=small .venv/bin/k6 run k6/closed.js
//   VUS=2000 DURATION=60s IMAGE_SET=small REQ_TIMEOUT=180s .venv/bin/k6 run k6/closed.js
//
// Env: VUS (10), DURATION (30s), GRACEFUL (time in-flight scans get at the end, 30s),
// plus everything k6/lib/scan.js reads (BASE_URL, FORM, IMAGE_SET, SUMMARY_JSON...).

import { SUMMARY_TREND_STATS, THRESHOLDS, checkReady, scanOnce } from './lib/scan.js';

export { handleSummary } from './lib/summary.js';

export const options = {
  scenarios: {
    closed: {
      executor: 'constant-vus',
      vus: parseInt(__ENV.VUS || '10', 10),
      duration: __ENV.DURATION || '30s',
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
  scanOnce();
}
