// The walk page: a phone's back camera streams over the /v1/stream websocket and each frame
// becomes one decision. `ahead` names the nearest hazard in the center 30 degrees; `side`, asked
// only after a danger label (ask_if, server-side), says which half of the frame the obstacle is in,
// and the arrow points the other way. One frame is in flight at a time: a result renders and the
// next frame goes out at once.
//
// Why the questions look like this (findings recorded with the page): asking for the turn directly
// ("which side is more open") was biased right whichever side the obstacle was on, while asking
// where the obstacle is was right at 0.95-1.00. A direction question in the same read as the
// hazard pulled the hazard toward obstacles, so ask_if puts it in a later stage.

import { bindApiKeyInput, errorMessage, StreamSession } from "./api.js";
import { captureJpeg, startCamera, stopCamera } from "./camera.js";

// name -> description, in the order the bars show them.
const HAZARDS = {
  "all clear ahead": "the path straight ahead is free for at least 2 meters",
  "danger: stairs": "stairs, steps or a curb ahead, up or down",
  "danger: wall ahead": "a wall, fence or closed barrier ahead",
  "danger: object ahead": "furniture, a pole, a parked bike, a box or another object in the path",
  "danger: pet ahead": "a dog, cat or other animal in the path",
  "door ahead": "a door directly ahead, open or closed",
};
const LABELS = Object.keys(HAZARDS);
const DANGERS = LABELS.filter((label) => label.startsWith("danger"));

const AHEAD_INSTRUCTIONS =
  "You are the eyes of a person walking forward. Judge only the center of the image: a window " +
  "about 30 degrees wide directly ahead. Ignore everything to the sides. If there is no obstacle " +
  "within 2 meters in that window, say all clear ahead; otherwise name the nearest hazard.";
const SIDE_INSTRUCTIONS =
  "There is an obstacle ahead. Where is the nearest obstacle, stairs, wall or obstruction in the frame?";
const NOTE =
  "one frame from a phone's back camera, pointed the way the person is walking; only the center 30 degrees matters";
// Without this the model tends to restate the task in its thought.
const THINK_INSTRUCTIONS =
  "Before answering, think in one short sentence about what is within 2 meters straight ahead. " +
  "Do not restate the question.";
const THINK_TOKENS = 64;

const FRAME_WIDTH = 512;
const FRAME_QUALITY = 0.7;
const RECONNECT_MS = 1000;
const ERROR_LINGER_MS = 3000; // an error stays readable on the status line for this long
const ARROWS = { "go ahead": "↑", "turn left": "←", "turn right": "→" };

const $ = (id) => document.getElementById(id);
const ui = {
  stage: $("stage"), video: $("video"), canvas: $("canvas"), arrow: $("arrow"), banner: $("banner"),
  toggle: $("toggle"), think: $("think"), meta: $("meta"), bars: $("bars"), apiKey: $("api-key"),
  status: $("status"),
};

const state = {
  running: false,
  link: null, // {session, inFlight, sentAt}: the current websocket; stale handlers compare against it
  reconnectTimer: null,
  frames: 0,
  dropped: 0,
  errorAt: 0,
};
const barRows = new Map(); // label -> {row, fill, pct}

// ------------------------------------------------------------------ the request

function buildRequest() {
  const request = {
    model: "jev-latest",
    state: { note: NOTE },
    samples: 1,
    questions: {
      ahead: { type: "choice", instructions: AHEAD_INSTRUCTIONS, criteria: HAZARDS },
      side: {
        type: "choice",
        instructions: SIDE_INSTRUCTIONS,
        criteria: { "left half": null, "right half": null },
        ask_if: { ahead: DANGERS },
      },
    },
  };
  if (ui.think.checked) {
    request.think = THINK_TOKENS;
    request.instructions = THINK_INSTRUCTIONS;
  }
  return request;
}

// ------------------------------------------------------------------ drawing

function hazardClass(label) {
  if (label.startsWith("all clear")) return "clear";
  if (label.startsWith("danger")) return "danger";
  if (label.startsWith("door")) return "door";
  return "idle";
}

function setBanner(text, kind) {
  ui.banner.textContent = text;
  ui.banner.className = `banner ${kind}`;
}

function setArrow(choice, confidence) {
  const text = `${choice} ${percent(confidence)}%`;
  ui.arrow.textContent = ARROWS[choice];
  ui.arrow.className = `arrow ${choice === "go ahead" ? "go" : "turn"}`;
  ui.arrow.title = text;
  ui.arrow.setAttribute("aria-label", text);
  ui.arrow.dataset.choice = choice;
}

function hideArrow() {
  ui.arrow.className = "arrow off";
  ui.arrow.textContent = "";
  ui.arrow.title = "";
  ui.arrow.setAttribute("aria-label", "no direction yet");
  delete ui.arrow.dataset.choice;
}

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle("status-error", isError);
  ui.status.title = text;
  if (isError) state.errorAt = performance.now();
}

function setToggle(running) {
  ui.toggle.textContent = running ? "Stop" : "Start";
  ui.toggle.classList.toggle("running", running);
}

const percent = (p) => Math.round(Math.max(0, Math.min(1, Number(p) || 0)) * 100);

// The rows exist before the first result, so a result only changes widths and numbers.
function buildBars() {
  for (const label of LABELS) {
    const row = document.createElement("div");
    row.className = `bar-row ${hazardClass(label)}`;
    row.dataset.label = label;
    row.title = HAZARDS[label];
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = label;
    const track = document.createElement("span");
    track.className = "track";
    const fill = document.createElement("span");
    fill.className = "fill";
    fill.style.display = "block";
    track.append(fill);
    const pct = document.createElement("span");
    pct.className = "pct";
    pct.textContent = "–";
    row.append(name, track, pct);
    ui.bars.append(row);
    barRows.set(label, { row, fill, pct });
  }
}

function updateBars(probabilities, top) {
  for (const [label, { row, fill, pct }] of barRows) {
    const p = probabilities?.[label] ?? 0;
    fill.style.width = `${(Math.max(0, Math.min(1, p)) * 100).toFixed(1)}%`;
    pct.textContent = `${percent(p)}%`;
    row.classList.toggle("top", label === top);
  }
}

// diagnostics.thought is null, one {tokens, ...}, or a list of them (one per read that thought,
// e.g. two on a blocked frame).
function thoughtTokens(thought) {
  const list = Array.isArray(thought) ? thought : [thought];
  return list.reduce((sum, t) => sum + (Number(t?.tokens) || 0), 0);
}

function render(message, roundTripMs) {
  const ahead = message.answers?.ahead;
  if (!ahead) {
    setStatus("error: the result has no answer for ahead", true);
    return;
  }
  const label = ahead.choice;
  const confidence = ahead.confidence ?? ahead.probabilities?.[label];
  setBanner(label, hazardClass(label));
  updateBars(ahead.probabilities, label);

  let meta = `${percent(confidence)}% · ${Math.round(roundTripMs)} ms`;
  const tokens = thoughtTokens(message.diagnostics?.thought);
  if (tokens) meta += ` · thought ${tokens} tok`;
  const side = message.answers?.side;
  if (side) {
    // The arrow points away from the obstacle's half.
    const obstacle = String(side.choice).startsWith("left") ? "left" : "right";
    setArrow(obstacle === "left" ? "turn right" : "turn left", side.confidence ?? side.probabilities?.[side.choice]);
    meta += ` · obstacle ${obstacle}`;
  } else {
    setArrow("go ahead", confidence);
  }
  ui.meta.textContent = meta;
}

// ------------------------------------------------------------------ the loop

async function start() {
  if (state.running) return;
  state.running = true;
  state.frames = 0;
  state.dropped = 0;
  setToggle(true);
  setBanner("looking...", "idle");
  setStatus("starting the camera...");
  try {
    await startCamera(ui.video, { facingMode: "environment", width: 640, height: 480 });
  } catch (err) {
    stop();
    setStatus(cameraError(err), true);
    return;
  }
  if (!state.running) {
    stopCamera(ui.video); // stopped while the browser asked for permission
    return;
  }
  openSession();
}

function stop() {
  state.running = false;
  clearTimeout(state.reconnectTimer);
  const link = state.link;
  state.link = null;
  link?.session.close();
  stopCamera(ui.video);
  setToggle(false);
  setBanner("stopped", "idle");
  hideArrow();
  setStatus("stopped");
}

function cameraError(err) {
  const local = ["localhost", "127.0.0.1", "[::1]"].includes(location.hostname);
  let text = `camera: ${err?.message || err?.name || err}`;
  if (location.protocol === "http:" && !local && !text.includes("https")) {
    text += " (webcam needs https; use the TLS port)";
  }
  return text;
}

function openSession() {
  const link = { session: null, inFlight: false, sentAt: 0 };
  const current = () => state.link === link && state.running;
  link.session = new StreamSession({
    onResult: (message) => current() && onResult(link, message),
    onError: (message) => current() && onError(link, message),
    onClose: (event) => current() && onClose(event),
  });
  state.link = link;
  link.session.configure(buildRequest()); // goes out as soon as the server says ready
  setStatus("connecting...");
  link.session.connect().then(
    () => {
      if (!current()) return;
      setStatus("running");
      step(link);
    },
    () => {}, // onClose reports it
  );
}

async function step(link) {
  if (state.link !== link || !state.running || link.inFlight) return;
  link.inFlight = true;
  let frame;
  try {
    frame = await captureJpeg(ui.video, ui.canvas, { width: FRAME_WIDTH, quality: FRAME_QUALITY });
  } catch (err) {
    link.inFlight = false;
    setStatus(`error: ${err.message}`, true);
    setTimeout(() => step(link), 200);
    return;
  }
  if (state.link !== link || !state.running) return;
  link.sentAt = performance.now();
  if (!(await link.session.sendFrame(frame))) link.inFlight = false;
}

function onResult(link, message) {
  link.inFlight = false;
  state.frames += 1;
  state.dropped = message.dropped_total ?? state.dropped;
  render(message, performance.now() - link.sentAt);
  ui.banner.dataset.frames = state.frames; // a counter for tests and debugging; not shown
  if (performance.now() - state.errorAt > ERROR_LINGER_MS) {
    const frames = `${state.frames} frame${state.frames === 1 ? "" : "s"}`;
    setStatus(`running · ${frames}${state.dropped ? ` · ${state.dropped} dropped` : ""}`);
  }
  step(link);
}

// A frame's error is reported and the next frame goes out at once. A config error (frame null)
// would fail every frame, so it stops the loop instead.
function onError(link, message) {
  const text = errorMessage(message.status, message).replace(/^HTTP \d+: /, "");
  setStatus(`error: ${text}`, true);
  if (message.frame == null) {
    stop();
    setStatus(`error: ${text}`, true);
    return;
  }
  link.inFlight = false;
  step(link);
}

// The socket closed under a running loop: a refused key stops it; anything else reconnects.
function onClose(event) {
  state.link = null;
  const reason = event.reason ? `: ${event.reason}` : "";
  if (event.code === 1008) {
    stop();
    setStatus(`error: api key refused${reason}`, true);
    return;
  }
  setStatus(`error: stream closed (${event.code}${reason}); reconnecting`, true);
  state.reconnectTimer = setTimeout(() => state.running && openSession(), RECONNECT_MS);
}

// ------------------------------------------------------------------ wiring

function init() {
  buildBars();
  bindApiKeyInput(ui.apiKey);
  ui.think.checked = false; // browsers may restore form state on reload
  ui.toggle.addEventListener("click", () => (state.running ? stop() : start()));
  ui.stage.addEventListener("click", () => { if (!state.running) start(); });
  // The next frame uses the new config; no need to reconnect.
  ui.think.addEventListener("change", () => state.link?.session.configure(buildRequest()));
  // A phone that locks or switches apps stops streaming (and stops paying for frames).
  document.addEventListener("visibilitychange", () => { if (document.hidden && state.running) stop(); });

  if (!navigator.mediaDevices?.getUserMedia) {
    setStatus(cameraError(new Error("no camera API")), true);
  } else if (document.body.dataset.keyRequired === "true" && !ui.apiKey.value) {
    setStatus("this server needs an api key");
  } else {
    setStatus("ready");
  }
}

init();
