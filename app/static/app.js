// ecoscan's "try it" page: downscale a photo, POST it, read the SSE stream with fetch.
// Plain ES module, no dependencies. The contract is docs/api.md's "The event stream".

import { resetItems, showItem, showItemRule, showItemsFromDone } from "./items.js?v=__VERSION__";

const SCAN_URL = "/api/v1/scan/classify/completion";
// The service's IMAGE_LONG_SIDE (app/http/page.py writes it into the page): a photo downscaled
// to it, a plain JPEG, goes to the model as it came, checked instead of re-encoded.
const LONG_SIDE = Number(document.querySelector('meta[name="ecoscan-image-long-side"]')?.content) || 768;
const JPEG_QUALITY = 0.85;
const RESUME_DELAYS_MS = [500, 1500, 3000];

const $ = (id) => document.getElementById(id);
const els = {
  form: $("scan-form"),
  camera: $("photo-camera"),
  pick: $("photo-pick"),
  preview: $("preview"),
  previewImg: $("preview-img"),
  previewCaption: $("preview-caption"),
  question: $("question"),
  userId: $("user-id"),
  send: $("send"),
  formStatus: $("form-status"),
  result: $("result"),
  stages: $("stages"),
  error: $("error"),
  errorMessage: $("error-message"),
  retry: $("retry"),
  classification: $("classification"),
  itemName: $("item-name"),
  category: $("category"),
  tags: $("tags"),
  ruleCard: $("rule-card"),
  ruleBody: $("rule-body"),
  answerCard: $("answer-card"),
  answerText: $("answer-text"),
  answerFinal: $("answer-final"),
  rewardCard: $("reward-card"),
  rewardBody: $("reward-body"),
  loadCollection: $("load-collection"),
  collectionStatus: $("collection-status"),
  collection: $("collection"),
};

// Korean messages for the service's error codes: what happened and what to do.
const MESSAGES = {
  IMAGE_MISSING: "사진이 없어요. 사진을 찍거나 골라 주세요.",
  IMAGE_INVALID: "사진을 읽을 수 없어요. 다른 사진으로 다시 시도해 주세요.",
  IMAGE_TYPE_UNSUPPORTED: "이 형식의 사진은 쓸 수 없어요. JPEG나 PNG 사진으로 다시 시도해 주세요.",
  IMAGE_TOO_LARGE: "사진이 너무 커요. 더 작은 사진으로 다시 시도해 주세요.",
  PAYLOAD_TOO_LARGE: "사진이 너무 커요. 더 작은 사진으로 다시 시도해 주세요.",
  IMAGE_TOO_MANY_PIXELS: "사진 해상도가 너무 높아요. 더 작은 사진으로 다시 시도해 주세요.",
  USER_INPUT_TOO_LONG: "질문이 너무 길어요. 500자 이내로 줄여 주세요.",
  INVALID_TEXT: "질문에 쓸 수 없는 문자가 있어요. 질문을 고쳐서 다시 보내 주세요.",
  INVALID_REQUEST: "요청이 올바르지 않아요. 아이디와 질문을 확인하고 다시 보내 주세요.",
  BODY_READ_TIMEOUT: "사진을 보내는 데 너무 오래 걸렸어요. 연결을 확인하고 다시 시도해 주세요.",
  UNAUTHENTICATED: "먼저 로그인(아이디 입력)이 필요해요.",
  TOKEN_INVALID: "로그인 정보가 올바르지 않아요. 다시 로그인해 주세요.",
  TOKEN_EXPIRED: "로그인이 만료됐어요. 다시 로그인해 주세요.",
  USER_CONCURRENCY_LIMIT: "이미 진행 중인 안내가 있어요. 끝난 뒤에 다시 시도해 주세요.",
  SERVER_BUSY: "지금 사용자가 많아요. 잠시 후 다시 시도해 주세요.",
  UPSTREAM_BUDGET_EXHAUSTED: "지금 요청이 많아요. 잠시 후 다시 시도해 주세요.",
  CPU_SATURATED: "지금 사진 처리가 밀려 있어요. 잠시 후 다시 시도해 주세요.",
  UPLOADS_AT_CAPACITY: "지금 사진 업로드가 많아요. 잠시 후 다시 시도해 주세요.",
  DATABASE_UNAVAILABLE: "서버에 일시적인 문제가 있어요. 잠시 후 다시 시도해 주세요.",
  SERVER_SHUTTING_DOWN: "서버가 점검을 위해 재시작하고 있어요. 잠시 후 다시 시도해 주세요.",
  SERVER_SHUTDOWN: "서버가 재시작되어 안내가 중단됐어요. 다시 시도해 주세요.",
  UPSTREAM_ERROR: "AI 서비스에 연결하지 못했어요. 잠시 후 다시 시도해 주세요.",
  UPSTREAM_RATE_LIMITED: "AI 서비스 요청이 많아요. 잠시 후 다시 시도해 주세요.",
  UPSTREAM_QUOTA_EXHAUSTED: "오늘 사용할 수 있는 양을 다 썼어요. 나중에 다시 이용해 주세요.",
  UPSTREAM_TIMEOUT: "AI 서비스의 응답이 늦어요. 다시 시도해 주세요.",
  UPSTREAM_BAD_RESPONSE: "AI의 답을 이해하지 못했어요. 다시 시도해 주세요.",
  UPSTREAM_TOKEN_LIMIT: "답이 너무 길어져 끝내지 못했어요. 질문을 짧게 해서 다시 시도해 주세요.",
  UPSTREAM_REFUSED: "AI가 이 요청에 답하지 않았어요. 다른 사진이나 질문으로 시도해 주세요.",
  UPSTREAM_CONTENT_FILTERED: "답이 안전 필터에 걸렸어요. 다른 사진이나 질문으로 시도해 주세요.",
  UPSTREAM_REJECTED: "AI 서비스가 요청을 받지 않았어요. 관리자에게 알려 주세요.",
  STAGE_TIMEOUT: "처리 시간이 너무 오래 걸렸어요. 다시 시도해 주세요.",
  SCAN_DEADLINE_EXCEEDED: "처리 시간이 너무 오래 걸렸어요. 다시 시도해 주세요.",
  DATABASE_ERROR: "결과를 저장하지 못했어요. 다시 시도해 주세요.",
  CANCELLED: "안내가 취소됐어요.",
  CLIENT_DISCONNECTED: "연결이 끊겨 안내가 중단됐어요. 다시 시도해 주세요.",
  PROCESS_LOST: "서버 문제로 안내가 중단됐어요. 다시 시도해 주세요.",
  SCAN_NOT_FOUND: "이전 안내를 찾을 수 없어요. 다시 시도해 주세요.",
  SCAN_RUNNING_ELSEWHERE: "안내가 다른 서버에서 진행 중이에요. 잠시 후 다시 시도해 주세요.",
  INTERNAL_ERROR: "서버에 문제가 생겼어요. 잠시 후 다시 시도해 주세요.",
};
const NETWORK_MESSAGE = "인터넷 연결이 끊겼어요. 연결을 확인하고 다시 시도해 주세요.";

class ApiError extends Error {
  constructor(status, code, detail, retryAfterS) {
    super(detail || code || `HTTP ${status}`);
    this.status = status;
    this.code = code;
    this.retryAfterS = retryAfterS;
  }
}

function messageFor(code, status) {
  if (code && MESSAGES[code]) return MESSAGES[code];
  if (status === 429 || status === 503) return MESSAGES.SERVER_BUSY;
  if (status >= 500) return MESSAGES.INTERNAL_ERROR;
  return "요청을 처리하지 못했어요. 다시 시도해 주세요.";
}

function randomKey() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function list(items, ordered = false) {
  const node = document.createElement(ordered ? "ol" : "ul");
  for (const item of items) node.append(el("li", item));
  return node;
}

function formatMs(ms) {
  if (typeof ms !== "number") return "";
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)}초` : `${Math.round(ms)}ms`;
}

// ---- the photo -----------------------------------------------------------------

let photo = null; // the File the user chose
let previewUrl = null;

function choose(file) {
  if (!file) return;
  photo = file;
  if (previewUrl) URL.revokeObjectURL(previewUrl);
  previewUrl = URL.createObjectURL(file);
  els.previewImg.src = previewUrl;
  els.previewCaption.textContent = file.name || "사진";
  els.preview.hidden = false;
  els.send.disabled = retryBlockedUntil > Date.now();
  setStatus("");
}

for (const input of [els.camera, els.pick]) {
  input.addEventListener("change", () => choose(input.files && input.files[0]));
}

// Downscale in the browser: the long side to LONG_SIDE px, re-encoded as JPEG. The
// service would do it too, but a phone's 12-megapixel photo is slow to upload, and
// re-encoding it there costs the service milliseconds of CPU per scan.
async function downscale(file) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(file, { imageOrientation: "from-image" });
  } catch {
    return file; // e.g. HEIC this browser cannot decode: let the service say what it accepts
  }
  try {
    const scale = Math.min(1, LONG_SIDE / Math.max(bitmap.width, bitmap.height));
    const width = Math.max(1, Math.round(bitmap.width * scale));
    const height = Math.max(1, Math.round(bitmap.height * scale));
    const canvas = document.createElement("canvas");
    canvas.width = width;
    canvas.height = height;
    canvas.getContext("2d").drawImage(bitmap, 0, 0, width, height);
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", JPEG_QUALITY));
    return blob ? await withoutBrowserSegments(blob) : file;
  } finally {
    bitmap.close();
  }
}

// A canvas's JPEG may carry segments of the browser's own besides its JFIF header
// (Chromium's: its sRGB ICC profile, APP2). Without them it is read as sRGB all the same
// (the orientation is already applied, by createImageBitmap), and it is a bare JFIF
// image, which the service sends on as it came instead of re-encoding it (app/images/prepare.py):
// APP1-APP15 and comments are left out, the rest kept byte for byte.
async function withoutBrowserSegments(blob) {
  const bytes = new Uint8Array(await blob.arrayBuffer());
  if (blob.type !== "image/jpeg" || bytes[0] !== 0xff || bytes[1] !== 0xd8) return blob;
  const kept = [bytes.subarray(0, 2)];
  let pos = 2;
  // Segments up to the first scan; a byte out of place ends the walk, the rest kept as is.
  while (pos + 4 <= bytes.length && bytes[pos] === 0xff && bytes[pos + 1] !== 0xda) {
    const marker = bytes[pos + 1];
    const end = pos + 2 + ((bytes[pos + 2] << 8) | bytes[pos + 3]);
    if (!((marker >= 0xe1 && marker <= 0xef) || marker === 0xfe)) kept.push(bytes.subarray(pos, end));
    pos = end;
  }
  kept.push(bytes.subarray(pos));
  return new Blob(kept, { type: "image/jpeg" });
}

// ---- SSE over fetch ------------------------------------------------------------

// Parses text/event-stream from a fetch Response body; calls onEvent({id, event, data}).
async function readEvents(response, onEvent, signal) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const abort = () => reader.cancel().catch(() => {});
  signal?.addEventListener("abort", abort, { once: true });
  let buffer = "";
  let event = { id: null, event: "message", data: [] };
  const dispatch = () => {
    if (event.data.length) onEvent({ id: event.id, event: event.event, data: event.data.join("\n") });
    event = { id: null, event: "message", data: [] };
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      let text = buffer + value;
      // A trailing "\r" may be half of a "\r\n" (sse-starlette's line ending): hold it back.
      const held = text.endsWith("\r") ? "\r" : "";
      if (held) text = text.slice(0, -1);
      const lines = text.split(/\r\n|\r|\n/);
      buffer = lines.pop() + held;
      for (const line of lines) {
        if (line === "") {
          dispatch();
          continue;
        }
        if (line.startsWith(":")) continue; // a comment (": ping")
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") event.data.push(val);
        else if (field === "event") event.event = val;
        else if (field === "id") event.id = val;
      }
    }
  } finally {
    signal?.removeEventListener("abort", abort);
  }
}

async function apiError(response) {
  let body = {};
  try {
    body = await response.json();
  } catch {
    /* not JSON: a proxy's page */
  }
  const retryAfter = Number.parseInt(response.headers.get("Retry-After") || "", 10);
  return new ApiError(response.status, body.code, body.detail, Number.isFinite(retryAfter) ? retryAfter : null);
}

// ---- one scan ------------------------------------------------------------------

let lastScan = null; // the latest scan started, for "다시 시도"
let current = null; // {controller, jobId, token, lastId, terminal, blob, question, userId, key}
let retryBlockedUntil = 0;
let retryTimer = null;

function setStatus(text) {
  els.formStatus.textContent = text;
}

function resetResult() {
  els.result.hidden = false;
  els.error.hidden = true;
  els.retry.hidden = true;
  for (const li of els.stages.children) setStage(li.dataset.step, "waiting");
  els.classification.hidden = true;
  els.ruleCard.hidden = true;
  els.answerCard.hidden = true;
  els.answerText.textContent = "";
  els.answerText.hidden = false;
  els.answerFinal.replaceChildren();
  els.rewardCard.hidden = true;
  els.result.removeAttribute("data-state");
}

function setStage(step, status, durationMs) {
  const li = els.stages.querySelector(`[data-step="${step}"]`);
  if (!li) return;
  li.dataset.status = status;
  const label = { waiting: "대기", started: "진행 중…", completed: "완료", failed: "실패" }[status];
  li.querySelector(".stage-state").textContent =
    status === "completed" && durationMs !== undefined ? `${label} · ${formatMs(durationMs)}` : label;
}

function showError(message, { retry = false } = {}) {
  els.errorMessage.textContent = message;
  els.error.hidden = false;
  els.retry.hidden = !retry;
  els.result.dataset.state = "error";
  for (const li of els.stages.children) {
    if (li.dataset.status === "started") setStage(li.dataset.step, "failed");
  }
}

function blockRetries(seconds) {
  retryBlockedUntil = Date.now() + seconds * 1000;
  clearInterval(retryTimer);
  const tick = () => {
    const left = Math.ceil((retryBlockedUntil - Date.now()) / 1000);
    if (left <= 0) {
      clearInterval(retryTimer);
      els.send.disabled = !photo;
      els.retry.disabled = false;
      els.retry.textContent = "다시 시도";
      setStatus("이제 다시 시도할 수 있어요.");
      return;
    }
    els.send.disabled = true;
    els.retry.disabled = true;
    els.retry.textContent = `${left}초 후 다시 시도`;
  };
  tick();
  retryTimer = setInterval(tick, 1000);
}

function renderClassification(data) {
  const c = data.classification || {};
  els.itemName.textContent = data.item_name || c.minor || c.middle || c.major || "알 수 없는 물건";
  els.category.textContent = [c.major, c.middle, c.minor].filter(Boolean).join(" › ");
  els.tags.replaceChildren(...(data.situation_tags || []).map((t) => el("li", t, "tag")));
  els.classification.hidden = false;
}

function renderRule(rules, reason) {
  const body = els.ruleBody;
  body.replaceChildren();
  if (!rules) {
    body.append(el("p", "이 물건의 배출 규정을 찾지 못했어요. 아래 안내를 참고하거나 지역 지침을 확인해 주세요."));
    if (reason) body.append(el("p", reason, "hint"));
  } else {
    body.append(el("p", rules.title, "rule-title"));
    if (rules.summary) body.append(el("p", rules.summary));
    if (rules.preparation?.length) body.append(el("h4", "버리기 전에"), list(rules.preparation, true));
    if (rules.disposal?.length) body.append(el("h4", "버리는 방법"), list(rules.disposal, true));
    if (rules.not_accepted?.length) {
      body.append(el("h4", "이건 안 돼요"));
      const ul = document.createElement("ul");
      for (const na of rules.not_accepted) {
        const li = el("li");
        li.append(el("strong", na.item), document.createTextNode(` → ${na.instead}`));
        ul.append(li);
      }
      body.append(ul);
    }
    if (rules.tips?.length) body.append(el("h4", "알아 두면 좋아요"), list(rules.tips));
  }
  els.ruleCard.hidden = false;
}

function renderAnswer(answer) {
  if (!answer) return;
  const box = els.answerFinal;
  box.replaceChildren();
  if (answer.user_answer) box.append(el("p", answer.user_answer, "user-answer"));
  if (answer.steps?.length) box.append(el("h4", "순서"), list(answer.steps, true));
  if (answer.insufficiencies?.length) {
    box.append(el("h4", "아직 해야 할 일"), list(answer.insufficiencies));
  }
  els.answerText.hidden = box.childElementCount > 0;
  els.answerCard.hidden = false;
}

function renderReward(reward, anonymous) {
  const body = els.rewardBody;
  body.replaceChildren();
  if (!reward) {
    body.append(
      el("p", "이번에는 받을 캐릭터가 없어요."),
      el("p", "재활용품을 안내대로 잘 준비하면 캐릭터를 받을 수 있어요.", "hint"),
    );
  } else {
    const ch = reward.character || {};
    body.append(el("p", ch.name, "character-name"));
    if (ch.dialog) body.append(el("blockquote", `“${ch.dialog}”`, "dialog"));
    let note;
    if (reward.received) note = "새 캐릭터를 받았어요! 내 컬렉션에 저장했어요.";
    else if (reward.already_owned) note = "이미 가지고 있는 캐릭터예요.";
    else if (anonymous) note = "아이디를 넣고 다시 하면 이 캐릭터를 모을 수 있어요.";
    else note = "캐릭터를 만났어요.";
    body.append(el("p", note, "badge"));
  }
  els.rewardCard.hidden = false;
}

function handleEvent(scan, sse) {
  if (sse.id) scan.lastId = sse.id;
  let data;
  try {
    data = JSON.parse(sse.data);
  } catch {
    return;
  }
  if (sse.event === "stage") {
    setStage(data.step, data.status, data.duration_ms);
    if (data.status !== "completed") {
      if (data.step === "answer") els.answerCard.hidden = false;
      return;
    }
    if (data.step === "vision") renderClassification(data);
    else if (data.step === "rule") renderRule(data.disposal_rules, data.reason);
    else if (data.step === "answer") renderAnswer(data.answer);
    else if (data.step === "reward") renderReward(data.reward, !scan.userId);
  } else if (sse.event === "item") {
    showItem(data);
  } else if (sse.event === "item_rule") {
    showItemRule(data);
  } else if (sse.event === "delta") {
    els.answerCard.hidden = false;
    els.answerText.append(data.text || "");
  } else if (sse.event === "discard") {
    // The answer is being written again (its call failed and started over elsewhere).
    els.answerText.textContent = "";
  } else if (sse.event === "done") {
    scan.terminal = true;
    // The stages are the service's list, written into the page (app/http/page.py).
    for (const li of els.stages.children) {
      const step = li.dataset.step;
      if (li.dataset.status !== "completed") setStage(step, "completed", data.timings?.[`${step}_ms`]);
    }
    renderClassification(data);
    renderRule(data.disposal_rules, data.disposal_rules_reason);
    showItemsFromDone(data);
    renderAnswer(data.answer);
    renderReward(data.reward, !scan.userId);
    els.result.dataset.state = "done";
    setStatus(`안내를 다 받았어요${data.timings ? ` (${formatMs(data.timings.total_ms)})` : ""}.`);
  } else if (sse.event === "error") {
    scan.terminal = true;
    const li = els.stages.querySelector(`[data-step="${data.step}"]`);
    if (li) setStage(data.step, "failed");
    showError(messageFor(data.code), { retry: data.retryable !== false || data.code === "CANCELLED" });
    setStatus("");
  }
}

function headersFor(scan) {
  const headers = {};
  if (scan.userId) headers["X-User-ID"] = scan.userId;
  return headers;
}

async function post(scan) {
  const form = new FormData();
  form.append("image", scan.blob, "photo.jpg");
  if (scan.question) form.append("user_input", scan.question);
  const response = await fetch(SCAN_URL, {
    method: "POST",
    body: form,
    headers: { ...headersFor(scan), "Idempotency-Key": scan.key, Accept: "text/event-stream" },
    signal: scan.controller.signal,
  });
  if (!response.ok) throw await apiError(response);
  scan.jobId = response.headers.get("X-Scan-Id") || scan.jobId;
  scan.token = response.headers.get("X-Scan-Token") || scan.token;
  return response;
}

async function resume(scan) {
  const url = new URL(`/api/v1/scan/${encodeURIComponent(scan.jobId)}/events`, location.href);
  const headers = { ...headersFor(scan), Accept: "text/event-stream" };
  // The header, not `?token=`: a query string lands in access logs (docs/api.md).
  if (scan.token) headers["X-Scan-Token"] = scan.token;
  if (scan.lastId) headers["Last-Event-ID"] = scan.lastId;
  const response = await fetch(url, { headers, signal: scan.controller.signal });
  if (!response.ok) throw await apiError(response);
  return response;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function run(scan) {
  current = scan;
  els.send.disabled = true;
  els.form.setAttribute("aria-busy", "true");
  els.result.dataset.state = "streaming";
  let attempt = 0;
  try {
    for (;;) {
      try {
        const response = attempt === 0 || !scan.jobId ? await post(scan) : await resume(scan);
        if (attempt > 0) setStatus("다시 연결했어요.");
        await readEvents(response, (sse) => handleEvent(scan, sse), scan.controller.signal);
        if (scan.terminal) return;
        // The stream ended without done/error: the connection dropped.
      } catch (err) {
        if (scan.controller.signal.aborted) return;
        if (err instanceof ApiError) {
          // Refused before any stream (or a resume refused): no point in resuming.
          if (err.retryAfterS !== null && (err.status === 429 || err.status === 503)) {
            showError(`${messageFor(err.code, err.status)} (${err.retryAfterS}초 후)`, { retry: true });
            blockRetries(err.retryAfterS);
          } else {
            showError(messageFor(err.code, err.status), { retry: err.status >= 500 || err.status === 409 });
          }
          return;
        }
        // A network error: resume below if the scan is known.
      }
      if (!scan.jobId || attempt >= RESUME_DELAYS_MS.length) {
        showError(NETWORK_MESSAGE, { retry: true });
        return;
      }
      setStatus("연결이 끊겼어요. 이어서 받는 중…");
      await sleep(RESUME_DELAYS_MS[attempt]);
      attempt += 1;
    }
  } finally {
    els.form.removeAttribute("aria-busy");
    if (retryBlockedUntil <= Date.now()) els.send.disabled = !photo;
    if (current === scan) current = null;
  }
}

async function start({ reuseKey = false } = {}) {
  if (!photo) {
    setStatus("먼저 사진을 찍거나 골라 주세요.");
    els.camera.focus();
    return;
  }
  if (current) current.controller.abort();
  const previous = lastScan;
  resetResult();
  els.result.focus({ preventScroll: false });
  setStatus("사진을 준비하는 중…");
  const blob = reuseKey && previous ? previous.blob : await downscale(photo);
  resetItems(blob);
  const scan = {
    controller: new AbortController(),
    jobId: null,
    token: null,
    lastId: null,
    terminal: false,
    blob,
    question: els.question.value.trim(),
    userId: els.userId.value.trim(),
    // A retry after a dropped connection reuses the key: the service answers with the
    // same scan (replayed) instead of starting and billing a second one.
    key: reuseKey && previous ? previous.key : randomKey(),
  };
  lastScan = scan;
  setStatus("보내는 중…");
  await run(scan);
}

els.form.addEventListener("submit", (event) => {
  event.preventDefault();
  start().catch(reportBug);
});

els.retry.addEventListener("click", () => {
  // Reuse the key only when the last attempt never reached a terminal event (same scan).
  const reuseKey = Boolean(lastScan && !lastScan.terminal && lastScan.jobId);
  start({ reuseKey }).catch(reportBug);
});

els.userId.value = localStorage.getItem("ecoscan.userId") || "";
els.userId.addEventListener("change", () => {
  const value = els.userId.value.trim();
  if (value) localStorage.setItem("ecoscan.userId", value);
  else localStorage.removeItem("ecoscan.userId");
});

function reportBug(err) {
  showError("페이지에 문제가 생겼어요. 새로고침한 뒤 다시 시도해 주세요.", { retry: false });
  console.warn(err);
}

// ---- my collection -------------------------------------------------------------

els.loadCollection.addEventListener("click", async () => {
  const userId = els.userId.value.trim();
  const status = els.collectionStatus;
  els.collection.replaceChildren();
  if (!userId) {
    status.textContent = "먼저 아이디를 넣어 주세요.";
    els.userId.closest("details").open = true;
    els.userId.focus();
    return;
  }
  status.textContent = "불러오는 중…";
  try {
    const response = await fetch("/api/v1/users/me/characters", { headers: { "X-User-ID": userId } });
    if (!response.ok) throw await apiError(response);
    const { characters } = await response.json();
    if (!characters.length) {
      status.textContent = "아직 모은 캐릭터가 없어요. 재활용품을 잘 버리면 받을 수 있어요.";
      return;
    }
    status.textContent = `캐릭터 ${characters.length}개를 모았어요.`;
    for (const ch of characters) {
      const li = el("li");
      li.append(el("strong", ch.name));
      if (ch.dialog) li.append(el("span", ` “${ch.dialog}”`, "dialog"));
      els.collection.append(li);
    }
  } catch (err) {
    status.textContent =
      err instanceof ApiError ? messageFor(err.code, err.status) : NETWORK_MESSAGE;
  }
});
