// The djev playground: edit a /v1/systemone request, send it with an optional image (a file or a
// webcam frame) and read the answers. One-shot and live webcam modes post over REST; realtime mode
// streams frames over the /v1/stream websocket, capturing the next frame once the answer returns
// and the server's next_frame_ms has passed since the last send.

import { bindApiKeyInput, errorMessage, postDecision, StreamSession } from "./api.js";
import { captureJpeg, startCamera, stopCamera } from "./camera.js";

const DEFAULT_EXAMPLE = {
  model: "jev-latest",
  state: { ticket: "Everything is down and we have a demo at noon. Fix it now." },
  samples: 1,
  questions: {
    urgent: { type: "noul", instructions: "Does the customer need a reply within the hour?" },
    team: {
      type: "choice",
      instructions: "Which team owns this?",
      criteria: { billing: null, outage: "service down", feature: null },
    },
    tone: { type: "score", instructions: "How angry is the customer?", criteria: ["calm", "annoyed", "furious"] },
  },
};

// Swapped in when a webcam mode is chosen and the textarea still holds the ticket example, which
// has no use for a picture.
const IMAGE_EXAMPLE = {
  model: "jev-latest",
  state: { note: "one photo attached" },
  samples: 1,
  questions: {
    scene: {
      type: "choice",
      instructions: "What does the photo show?",
      criteria: {
        "a person": null,
        "a room with nobody in it": null,
        "an object held up to the camera": null,
        "something else": null,
      },
    },
    hand: { type: "noul", instructions: "Is a hand visible?" },
  },
};

const JPEG_QUALITY = 0.85;
// Realtime frames are scaled to the walk page's width, so a realtime session here sends what the
// walk page sends (and a camera's native width does not add upload time to every frame).
const REALTIME_FRAME_WIDTH = 512;
const RECONFIGURE_DELAY_MS = 500;
// The realtime pace until the server gives one (next_frame_ms in `ready` and each result), and the
// longest wait taken from it.
const DEFAULT_FRAME_MS = 0; // a server that sends no next_frame_ms: the next frame at once
const MAX_FRAME_MS = 10000;
const WEBCAM_MODES = ["oneshot", "live", "realtime"];

const $ = (id) => document.getElementById(id);
const ui = {
  request: $("request"), send: $("send"), seed: $("seed"), status: $("status"),
  mode: $("mode"), file: $("file"), capture: $("capture"), every: $("every"),
  liveToggle: $("live-toggle"), rtToggle: $("rt-toggle"), rtCount: $("rt-count"),
  apiKey: $("api-key"), video: $("video"), canvas: $("canvas"), preview: $("preview"),
  answers: document.querySelector("#answers tbody"), meta: $("meta"), raw: $("raw"),
};

const state = {
  blob: null, // the image posted with the next REST request: a chosen file or a captured frame
  previewUrl: null, // object URL behind the preview, revoked when replaced
  inFlight: false, // one REST request at a time
  camera: "off", // off | starting | on
  cameraStart: null, // the promise of a start in progress
  liveTimer: null,
  rt: null, // the running realtime loop (see startRealtime)
  reconfigureTimer: null,
};

const pretty = (value) => JSON.stringify(value, null, 2);
const mode = () => ui.mode.value;

// ------------------------------------------------------------------ status and request

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle("status-error", isError);
}

// The textarea as a request object with the seed field applied, or null (and a red status).
function readRequest({ quiet = false } = {}) {
  let request;
  try {
    request = JSON.parse(ui.request.value);
  } catch (err) {
    if (!quiet) setStatus(`request is not JSON: ${err.message}`, true);
    return null;
  }
  if (!request || typeof request !== "object" || Array.isArray(request)) {
    if (!quiet) setStatus("request is not JSON: expected an object", true);
    return null;
  }
  request.seed = parseInt(ui.seed.value, 10) || 42;
  return request;
}

// id -> question type, so a skipped (null) answer's row can still say what it was.
function questionTypes(request) {
  const types = {};
  for (const [id, question] of Object.entries(request?.questions ?? {})) types[id] = question?.type ?? "";
  return types;
}

function isDefaultExample(text) {
  try {
    return JSON.stringify(JSON.parse(text)) === JSON.stringify(DEFAULT_EXAMPLE);
  } catch (_) {
    return false;
  }
}

// ------------------------------------------------------------------ REST send

async function send() {
  if (state.inFlight) return false;
  if (mode() === "file" && !state.blob) pickFile();
  const request = readRequest();
  if (!request) return false;
  if (!state.blob && Array.isArray(request.images) && typeof request.images[0] === "string") {
    showPreview(request.images[0]);
  }
  state.inFlight = true;
  ui.send.disabled = true;
  setStatus("sending...");
  try {
    const response = await postDecision(request, state.blob ? [state.blob] : []);
    if (!response.ok || !response.body) {
      setStatus(errorMessage(response.status, response.body, response.text), true);
      ui.raw.textContent = response.body ? pretty(response.body) : response.text;
      return false;
    }
    renderResponse(response.body, { roundTripMs: response.ms, types: questionTypes(request) });
    setStatus(`HTTP ${response.status}`);
    return true;
  } catch (err) {
    setStatus(`network error: ${err.message}`, true);
    return false;
  } finally {
    state.inFlight = false;
    ui.send.disabled = false;
  }
}

// ------------------------------------------------------------------ rendering answers

function renderResponse(body, { roundTripMs, serverMs = null, types = {} }) {
  ui.raw.textContent = pretty(body);
  renderAnswers(body.answers ?? {}, body.diagnostics?.skipped ?? {}, types);
  ui.meta.textContent = metaLine(body, roundTripMs, serverMs);
}

function renderAnswers(answers, skipped, types) {
  const rows = Object.entries(answers).map(([id, answer]) => answerRow(id, answer, skipped[id], types[id]));
  ui.answers.replaceChildren(...rows);
}

function answerRow(id, answer, skip, askedType) {
  const row = document.createElement("tr");
  row.dataset.id = id;
  const { type, result, why, confidence } = describe(answer, skip);
  if (answer == null) row.classList.add("skipped");
  row.append(cell(id), cell(type || askedType || ""));
  const resultCell = cell(result, "result");
  if (why) {
    const small = document.createElement("span");
    small.className = "why";
    small.textContent = ` (${why})`;
    resultCell.append(small);
  }
  row.append(resultCell, cell(confidence == null ? "" : confidence.toFixed(2), "confidence"));
  return row;
}

function cell(text, className = "") {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

// One answer as table text. A null answer was skipped by ask_if; diagnostics.skipped says why.
function describe(answer, skip) {
  if (answer == null) return { type: "", result: "skipped", why: skipReason(skip), confidence: null };
  const type = answer.type ?? "?";
  if (type === "noul") {
    const p = Number(answer.noul);
    return { type, result: `${p >= 0.5 ? "yes" : "no"} (p=${p.toFixed(2)})`, confidence: Math.max(p, 1 - p) };
  }
  if (type === "choice") return { type, result: String(answer.choice), confidence: answer.confidence ?? null };
  if (type === "score") {
    const probabilities = Object.entries(answer.probabilities ?? {});
    const [topIndex] = probabilities.reduce((best, entry) => (entry[1] > best[1] ? entry : best), ["0", -1]);
    const level = answer.legend?.[topIndex] ?? topIndex;
    const name = typeof level === "string" ? level : JSON.stringify(level);
    const score = Number.isFinite(answer.score)
      ? answer.score
      : probabilities.reduce((sum, [index, p]) => sum + Number(index) * p, 0);
    return { type, result: `${name} (score ${score.toFixed(2)})`, confidence: answer.confidence ?? null };
  }
  return { type, result: JSON.stringify(answer), confidence: answer.confidence ?? null };
}

function skipReason(skip) {
  if (!skip) return "";
  const was = skip.was == null ? "skipped" : JSON.stringify(skip.was);
  return `${skip.because} was ${was}`;
}

// "<rt> ms round trip, <server> ms in the server, <n> read(s), usage {...}; thought: <text>".
function metaLine(body, roundTripMs, serverMs) {
  const diagnostics = body.diagnostics ?? {};
  const parts = [`${Math.round(roundTripMs)} ms round trip`];
  const server = serverMs ?? diagnostics.timing?.total_ms;
  if (server != null) parts.push(`${Math.round(server)} ms in the server`);
  const n = diagnostics.samples?.n;
  if (n != null) {
    const reads = Array.isArray(n) ? n : [n];
    const total = reads.reduce((sum, x) => sum + Number(x || 0), 0);
    parts.push(`${reads.join("+")} read${total === 1 ? "" : "s"}`);
  }
  if (body.usage) parts.push(`usage ${JSON.stringify(body.usage)}`);
  const thought = thoughtText(diagnostics.thought);
  return parts.join(", ") + (thought ? `; thought: ${thought}` : "");
}

// diagnostics.thought is null, one {tokens, text}, or a list of them (one per read that thought).
function thoughtText(thought) {
  const list = Array.isArray(thought) ? thought : [thought];
  return list
    .filter((t) => t && typeof t.text === "string" && t.text.trim())
    .map((t) => t.text.trim())
    .join(" | ");
}

// ------------------------------------------------------------------ images and the camera

function showPreview(source) {
  if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
  state.previewUrl = source instanceof Blob ? URL.createObjectURL(source) : null;
  ui.preview.src = state.previewUrl ?? source;
  ui.preview.hidden = false;
}

function clearImage() {
  state.blob = null;
  if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
  state.previewUrl = null;
  ui.preview.removeAttribute("src");
  ui.preview.hidden = true;
}

function pickFile() {
  const file = ui.file.files?.[0];
  if (!file) return;
  state.blob = file;
  showPreview(file);
}

// Resolves true once the camera runs; concurrent callers share one start.
function ensureCamera() {
  if (state.camera === "on") return Promise.resolve(true);
  if (state.camera !== "starting") {
    state.camera = "starting";
    state.cameraStart = openCamera();
  }
  return state.cameraStart;
}

async function openCamera() {
  setStatus("starting the camera...");
  try {
    await startCamera(ui.video, { facingMode: "user", width: 640, height: 480 });
  } catch (err) {
    state.camera = "off";
    setStatus(`camera: ${err.message}`, true);
    return false;
  }
  // The mode may have changed away from the webcam while the browser asked for permission.
  if (state.camera !== "starting" || !WEBCAM_MODES.includes(mode())) {
    stopCamera(ui.video);
    state.camera = "off";
    return false;
  }
  state.camera = "on";
  ui.video.hidden = false;
  setStatus("camera on");
  return true;
}

function dropCamera() {
  stopCamera(ui.video);
  state.camera = "off";
  ui.video.hidden = true;
}

async function captureFrame() {
  const blob = await captureJpeg(ui.video, ui.canvas, { quality: JPEG_QUALITY });
  return new File([blob], "image.jpg", { type: "image/jpeg" });
}

async function captureAndSend() {
  if (state.inFlight) return false;
  if (!(await ensureCamera())) return false;
  state.blob = await captureFrame();
  showPreview(state.blob);
  return send();
}

// ------------------------------------------------------------------ modes

function showModeControls(selected) {
  document.querySelectorAll(".mode-controls").forEach((el) => { el.hidden = el.dataset.mode !== selected; });
}

// Changing mode stops any loop; `none` and `file` stop the camera, webcam modes start it.
async function setMode(selected) {
  stopLive();
  stopRealtime();
  showModeControls(selected);
  clearImage();
  if (selected === "none") {
    dropCamera();
    ui.file.value = "";
    setStatus("");
  } else if (selected === "file") {
    dropCamera();
    pickFile();
    setStatus("");
  } else {
    // Swapped before the camera starts, so a request sent meanwhile is the one on screen.
    if (isDefaultExample(ui.request.value)) setRequestText(pretty(IMAGE_EXAMPLE));
    await ensureCamera();
  }
}

// ------------------------------------------------------------------ live (REST every N seconds)

function liveSeconds() {
  return Math.max(0.5, parseFloat(ui.every.value) || 2);
}

function startLive() {
  stopLive();
  state.liveTimer = setInterval(liveTick, liveSeconds() * 1000);
  setToggle(ui.liveToggle, true);
  liveTick();
}

function stopLive() {
  clearInterval(state.liveTimer);
  state.liveTimer = null;
  setToggle(ui.liveToggle, false);
}

function liveTick() {
  // Skip a tick rather than queue requests behind a slow one.
  if (!state.inFlight && state.camera === "on") captureAndSend();
}

function setToggle(button, running) {
  button.textContent = running ? "Stop" : "Start";
  button.classList.toggle("running", running);
}

// ------------------------------------------------------------------ realtime (websocket)

// The loop keeps one frame in flight: capture -> send -> result -> (next_frame_ms after the send)
// capture again. `rt` identifies one run; handlers of a stopped run see state.rt !== rt and do nothing.
async function startRealtime() {
  stopRealtime();
  // The request is read once the camera runs: starting it may swap in the image example.
  if (!(await ensureCamera())) return;
  const request = readRequest();
  if (!request) return;
  delete request.images; // the frames are the images; the server refuses images in a config
  const rt = {
    session: null, sent: 0, decided: 0, dropped: 0, sentAt: -Infinity, types: questionTypes(request),
    nextFrameMs: DEFAULT_FRAME_MS, stepTimer: null,
  };
  rt.session = new StreamSession({
    onResult: (message) => state.rt === rt && onRealtimeResult(rt, message),
    onError: (message) => state.rt === rt && onRealtimeError(rt, message),
    onClose: (event) => state.rt === rt && onRealtimeClose(event),
  });
  state.rt = rt;
  setToggle(ui.rtToggle, true);
  updateCounter(rt);
  rt.session.configure(request); // sent as soon as the server says ready
  setStatus("connecting...");
  let ready;
  try {
    ready = await rt.session.connect();
  } catch (_) {
    return; // onRealtimeClose already said why
  }
  if (state.rt !== rt) return;
  setRealtimePace(rt, ready.next_frame_ms);
  setStatus("realtime: running");
  realtimeStep(rt);
}

async function realtimeStep(rt) {
  let frame;
  try {
    frame = await captureJpeg(ui.video, ui.canvas, { width: REALTIME_FRAME_WIDTH, quality: JPEG_QUALITY });
  } catch (err) {
    if (state.rt !== rt) return;
    setStatus(`realtime stopped: ${err.message}`, true);
    stopRealtime();
    return;
  }
  if (state.rt !== rt) return;
  rt.sentAt = performance.now();
  if (await rt.session.sendFrame(frame)) {
    rt.sent += 1;
    updateCounter(rt);
  }
}

function setRealtimePace(rt, nextFrameMs) {
  const ms = Number(nextFrameMs);
  if (nextFrameMs == null || !Number.isFinite(ms) || ms < 0) return;
  rt.nextFrameMs = Math.min(ms, MAX_FRAME_MS);
  ui.rtCount.dataset.nextFrameMs = rt.nextFrameMs;
}

// The next frame no sooner than next_frame_ms after the last send (the answer is in already).
function realtimeStepPaced(rt) {
  clearTimeout(rt.stepTimer);
  const wait = rt.sentAt + rt.nextFrameMs - performance.now();
  if (wait > 0) rt.stepTimer = setTimeout(() => state.rt === rt && realtimeStep(rt), wait);
  else realtimeStep(rt);
}

function onRealtimeResult(rt, message) {
  rt.decided += 1;
  rt.dropped = message.dropped_total ?? rt.dropped;
  const roundTripMs = performance.now() - rt.sentAt;
  renderResponse(message, { roundTripMs, serverMs: message.timing?.total_ms, types: rt.types });
  updateCounter(rt);
  // A "config not applied" error stays up until the next edit.
  if (!ui.status.classList.contains("status-error")) setStatus("realtime: running");
  setRealtimePace(rt, message.next_frame_ms);
  realtimeStepPaced(rt);
}

// A frame error stops the loop. A config error (frame null) stops it only before the first
// result: later it came from an edit, and the server keeps deciding with the previous config.
function onRealtimeError(rt, message) {
  const text = errorMessage(message.status, message);
  if (message.frame == null && rt.decided > 0) {
    setStatus(`config not applied: ${text}`, true);
    return;
  }
  ui.raw.textContent = pretty(message);
  setStatus(`realtime stopped: ${text}`, true);
  stopRealtime();
}

function onRealtimeClose(event) {
  setStatus(`realtime stopped: stream closed (${event.code}${event.reason ? ": " + event.reason : ""})`, true);
  stopRealtime();
}

function stopRealtime() {
  const rt = state.rt;
  if (!rt) return;
  state.rt = null;
  clearTimeout(rt.stepTimer);
  rt.session.close();
  setToggle(ui.rtToggle, false);
}

function updateCounter(rt) {
  ui.rtCount.textContent = `${rt.sent} sent · ${rt.decided} decided, ${rt.dropped} dropped`;
  Object.assign(ui.rtCount.dataset, { sent: rt.sent, decided: rt.decided, dropped: rt.dropped });
}

// Edits while realtime runs re-send the config (debounced); the next frame uses it.
function scheduleReconfigure() {
  if (!state.rt) return;
  clearTimeout(state.reconfigureTimer);
  state.reconfigureTimer = setTimeout(reconfigure, RECONFIGURE_DELAY_MS);
}

function reconfigure() {
  clearTimeout(state.reconfigureTimer);
  const rt = state.rt;
  const request = rt && readRequest();
  if (!request) return;
  delete request.images;
  rt.types = questionTypes(request);
  rt.session.configure(request);
  setStatus("realtime: running");
}

// The textarea's text set by the page (no input event): a running session takes it up at once.
function setRequestText(text) {
  ui.request.value = text;
  reconfigure();
}

// ------------------------------------------------------------------ #req= autoload

// "#req=<base64 JSON>", URL-encoded. Accepts base64url and missing padding too.
function decodeRequestFragment(hash) {
  const encoded = decodeURIComponent(hash.slice("#req=".length)).replace(/\s/g, "");
  const base64 = encoded.replace(/-/g, "+").replace(/_/g, "/");
  const padded = base64 + "===".slice((base64.length + 3) % 4);
  const bytes = Uint8Array.from(atob(padded), (ch) => ch.charCodeAt(0));
  return JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
}

function autoload() {
  if (!location.hash.startsWith("#req=")) return;
  try {
    setRequestText(pretty(decodeRequestFragment(location.hash)));
  } catch (err) {
    setStatus(`bad #req: ${err.message}`, true);
    return;
  }
  send();
}

// ------------------------------------------------------------------ wiring

function init() {
  ui.request.value = pretty(DEFAULT_EXAMPLE);
  ui.mode.value = "none"; // browsers may restore a previous selection on reload
  showModeControls("none");
  bindApiKeyInput(ui.apiKey);
  if (document.body.dataset.keyRequired === "true" && !ui.apiKey.value) {
    setStatus("this server needs an api key");
  }

  ui.send.addEventListener("click", () => send());
  ui.request.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      send();
    }
  });
  ui.request.addEventListener("input", scheduleReconfigure);
  ui.seed.addEventListener("change", scheduleReconfigure);
  ui.mode.addEventListener("change", () => setMode(mode()));
  ui.file.addEventListener("change", () => {
    clearImage();
    pickFile();
  });
  ui.capture.addEventListener("click", () => captureAndSend());
  ui.liveToggle.addEventListener("click", () => (state.liveTimer ? stopLive() : startLive()));
  ui.every.addEventListener("change", () => {
    if (state.liveTimer) startLive();
  });
  ui.rtToggle.addEventListener("click", () => (state.rt ? stopRealtime() : startRealtime()));
  window.addEventListener("hashchange", autoload);
  window.addEventListener("pagehide", () => {
    stopLive();
    stopRealtime();
    dropCamera();
  });

  autoload();
}

init();
