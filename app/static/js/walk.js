// The walk page: a phone's back camera streams over the /v1/stream websocket and each frame
// becomes one decision. `ahead` names the nearest hazard in the center 30 degrees; `side`, asked
// only after a danger label (ask_if, server-side), says which half of the frame the obstacle is in,
// and the arrow points the other way. One frame is in flight at a time: a result renders and the
// next frame goes out at the server's pace, next_frame_ms after the previous one (sooner would only
// make every camera's answers older when the server is shared; see docs/wire.md §10).
//
// A walking aid must never show an old answer as if it were current: every shown answer carries its
// age, counted from the capture of its frame, and an answer older than STALE_MS (or none at all: a
// dropped socket, a stopped camera, a server answering errors) is replaced by "no answer — stop",
// on screen, by voice and by vibration (walk-cues.js), until fresh answers flow again. Drawing is in
// walk-view.js.
//
// Why the questions look like this (findings recorded with the page): asking for the turn directly
// ("which side is more open") was biased right whichever side the obstacle was on, while asking
// where the obstacle is was right at 0.95-1.00. A direction question in the same read as the
// hazard pulled the hazard toward obstacles, so ask_if puts it in a later stage.

import { bindApiKeyInput, errorMessage, StreamSession } from "./api.js";
import { captureJpeg, startCamera, stopCamera } from "./camera.js";
import {
  Announcer, enterFullscreen, exitFullscreen, phraseFor, ScreenLock, Voice,
} from "./walk-cues.js";
import {
  buildBars, hazardClass, hideArrow, metaText, setArrow, setBanner, setMuteButton, setToggle, showAge, ui, updateBars,
} from "./walk-view.js";

// name -> description, in the order the bars show them.
const HAZARDS = {
  "all clear ahead": "the path straight ahead is free for at least 2 meters",
  "danger: stairs": "stairs, steps or a curb ahead, up or down",
  "danger: wall ahead": "a wall, fence or closed barrier ahead",
  "danger: object ahead": "furniture, a pole, a parked bike, a box or another object in the path",
  "danger: pet ahead": "a dog, cat or other animal in the path",
  "door ahead": "a door directly ahead, open or closed",
};
const DANGERS = Object.keys(HAZARDS).filter((label) => label.startsWith("danger"));

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
// The pace until the server gives one (its `ready` and every result carry next_frame_ms), and the
// longest wait the page accepts from it.
const DEFAULT_FRAME_MS = 0; // a server that sends no next_frame_ms: the next frame at once
const MAX_FRAME_MS = 10000;
// A full server closes a session it cannot serve fresh with 1013 ("try again later"). The page then
// waits longer each time (2 s, 4 s, ... up to 30 s), each wait jittered to 50-150 %, so refused
// phones do not all knock again together every second.
const BUSY_FIRST_MS = 2000;
const BUSY_MAX_MS = 30000;
const ERROR_LINGER_MS = 3000; // an error stays readable on the status line for this long

// The oldest answer the page will show, counted from the capture of its frame. At a walking pace
// of about 1.4 m/s, 1.5 s is the 2 meters the hazard question looks ahead: an older answer
// describes ground the person may already be standing on. `?stale_ms=` overrides it (for tests;
// raising it trades safety for slower answers); the guard itself cannot be turned off.
const STALE_MS = staleLimit(new URLSearchParams(location.search).get("stale_ms"), 1500);
const TICK_MS = 100; // how often the shown age (and the guard) is brought up to date
const NO_ANSWER = "no answer — stop";

function staleLimit(text, fallback) {
  const value = Number(text);
  return text !== null && Number.isFinite(value) && value > 0 ? Math.min(value, 600_000) : fallback;
}

const state = {
  running: false, // the person pressed Start and not Stop
  suspended: false, // running, but the page is hidden: camera and socket closed until it is visible
  // {session, inFlight, sent, captured: Map(frame number -> capture time), sentAt, nextFrameMs,
  // stepTimer}: the current websocket; handlers of an older one compare against it and do nothing.
  link: null,
  reconnectTimer: null,
  busyRefusals: 0, // 1013 closes in a row, since the last answer: how long the next wait is
  ticker: null,
  shown: null, // {capturedAt}: the answer on screen, while it is fresh
  waitingSince: 0, // with nothing shown, when the page began waiting for an answer
  noAnswer: false, // "no answer — stop" is on screen
  frames: 0,
  dropped: 0,
  slow: 0, // answers that arrived older than STALE_MS this run
  slowSaid: false,
  errorAt: -Infinity, // when an error was last put on the status line
  speechNoted: false,
};
const voice = new Voice();
const announcer = new Announcer(voice);
const screenLock = new ScreenLock();

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

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle("status-error", isError);
  ui.status.title = text;
  if (isError) state.errorAt = performance.now();
}

// A fresh answer: banner, bars, arrow, meta, and the cue for the ear.
function render(message, capturedAt, answerMs) {
  const ahead = message.answers.ahead;
  const label = ahead.choice;
  const confidence = ahead.confidence ?? ahead.probabilities?.[label];
  const kind = hazardClass(label);
  setBanner(label, kind);
  updateBars(ahead.probabilities, label);
  ui.bars.classList.remove("stale");

  const side = message.answers?.side;
  let obstacle = null;
  if (side) {
    // The arrow points away from the obstacle's half.
    obstacle = String(side.choice).startsWith("left") ? "left" : "right";
    setArrow(obstacle === "left" ? "turn right" : "turn left", side.confidence ?? side.probabilities?.[side.choice]);
  } else {
    setArrow("go ahead", confidence);
  }
  ui.meta.textContent = metaText(message, confidence, answerMs, obstacle);
  state.shown = { capturedAt };
  state.noAnswer = false;
  showAge(performance.now() - capturedAt, STALE_MS);
  announcer.answer(kind === "idle" ? "door" : kind, phraseFor(label, obstacle), performance.now());
}

// Nothing current to show: the label gives way to "no answer — stop", said and felt once per
// episode; the bars stay, greyed, for whoever wants to see what the last answer was.
function showNoAnswer() {
  state.shown = null;
  if (state.noAnswer) return;
  state.noAnswer = true;
  setBanner(NO_ANSWER, "noanswer");
  hideArrow();
  ui.bars.classList.add("stale");
  announcer.noAnswer();
}

// Called every TICK_MS while running: the shown age moves on, and an answer past the limit (or a
// wait for the first one past the limit) turns into "no answer".
function tick() {
  const now = performance.now();
  if (state.shown) {
    const age = now - state.shown.capturedAt;
    showAge(age, STALE_MS);
    if (age > STALE_MS) showNoAnswer();
  } else if (!state.noAnswer && now - state.waitingSince > STALE_MS) {
    showNoAnswer();
  }
  if (state.link && !cameraLive()) cameraStopped();
}

// ------------------------------------------------------------------ the loop

async function start() {
  if (state.running) return;
  state.running = true;
  state.frames = 0;
  state.busyRefusals = 0;
  state.dropped = 0;
  state.slow = 0;
  state.slowSaid = false;
  setToggle(true);
  announcer.reset();
  enterFullscreen();
  screenLock.acquire();
  await resume();
  if (!voice.available && !state.speechNoted && state.running) {
    state.speechNoted = true; // said once per page: the mute button keeps saying "no voice"
    setStatus("no speech in this browser: watch the banner; vibration still works where the phone has it", true);
  }
}

// Camera and socket up, the guard armed. Used by Start and when a hidden page is visible again.
async function resume() {
  state.suspended = false;
  state.shown = null;
  state.noAnswer = false;
  state.waitingSince = performance.now();
  setBanner("looking...", "idle");
  hideArrow();
  showAge(null, STALE_MS);
  clearInterval(state.ticker);
  state.ticker = setInterval(tick, TICK_MS);
  setStatus("starting the camera...");
  try {
    await startCamera(ui.video, { facingMode: "environment", width: 640, height: 480 });
  } catch (err) {
    halt(cameraError(err));
    return;
  }
  if (!state.running || state.suspended) {
    stopCamera(ui.video); // stopped (or hidden) while the browser asked for permission
    return;
  }
  for (const track of ui.video.srcObject?.getVideoTracks?.() ?? []) {
    track.addEventListener("ended", () => state.link && cameraStopped());
  }
  openSession();
}

// Camera and socket down, no timers. The answer on screen is left to the caller.
function suspend() {
  clearTimeout(state.reconnectTimer);
  clearInterval(state.ticker);
  state.ticker = null;
  const link = state.link;
  state.link = null;
  clearTimeout(link?.stepTimer);
  link?.session.close();
  stopCamera(ui.video);
  state.shown = null;
}

function stop() {
  state.running = false;
  state.suspended = false;
  suspend();
  screenLock.release();
  exitFullscreen();
  announcer.reset();
  setToggle(false);
  setBanner("stopped", "idle");
  hideArrow();
  showAge(null, STALE_MS);
  ui.bars.classList.remove("stale");
  setStatus("stopped");
}

// The loop ended without the person asking (a refused key, a camera that failed or stopped, a
// config the server rejects): the page stops, and says there is no answer.
function halt(reason) {
  stop();
  state.noAnswer = false;
  showNoAnswer();
  setStatus(`error: ${reason.replace(/^error: /, "")}`, true);
}

function cameraLive() {
  const tracks = ui.video.srcObject?.getVideoTracks?.() ?? [];
  return tracks.length > 0 && tracks.every((track) => track.readyState === "live");
}

function cameraStopped() {
  if (state.running) halt("the camera stopped; press Start");
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
  const link = {
    session: null, inFlight: false, sent: 0, captured: new Map(),
    sentAt: -Infinity, nextFrameMs: DEFAULT_FRAME_MS, stepTimer: null,
  };
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
    (ready) => {
      if (!current()) return;
      setPace(link, ready.next_frame_ms);
      if (performance.now() - state.errorAt > ERROR_LINGER_MS) setStatus("running");
      step(link);
    },
    () => {}, // onClose reports it
  );
}

async function step(link) {
  if (state.link !== link || !state.running || link.inFlight) return;
  if (!cameraLive()) {
    cameraStopped();
    return;
  }
  link.inFlight = true;
  const capturedAt = performance.now();
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
  if (await link.session.sendFrame(frame)) {
    // The server numbers a session's frames from 1, in the order they arrive.
    link.sentAt = performance.now();
    link.sent += 1;
    link.captured.set(link.sent, capturedAt);
  } else {
    link.inFlight = false;
  }
}

// The server's pace: how long after a send the next frame may go (a missing or odd value keeps the
// last one).
function setPace(link, nextFrameMs) {
  const ms = Number(nextFrameMs);
  if (nextFrameMs == null || !Number.isFinite(ms) || ms < 0) return;
  link.nextFrameMs = Math.min(ms, MAX_FRAME_MS);
  ui.banner.dataset.nextFrameMs = link.nextFrameMs; // for tests and debugging; not shown
}

// The next frame, once the answer to the last one is in (the callers) and no sooner than
// next_frame_ms after the last send.
function stepPaced(link) {
  clearTimeout(link.stepTimer);
  const wait = link.sentAt + link.nextFrameMs - performance.now();
  if (wait > 0) link.stepTimer = setTimeout(() => step(link), wait);
  else step(link);
}

// The capture time of a frame the server answered (or gave up on); older entries go with it.
function takeCaptureTime(link, frame) {
  const capturedAt = link.captured.get(frame) ?? null;
  for (const number of link.captured.keys()) if (number <= frame) link.captured.delete(number);
  return capturedAt;
}

function onResult(link, message) {
  link.inFlight = false;
  state.busyRefusals = 0;
  state.frames += 1;
  state.dropped = message.dropped_total ?? state.dropped;
  ui.banner.dataset.frames = state.frames; // a counter for tests and debugging; not shown
  const capturedAt = takeCaptureTime(link, message.frame);
  if (!message.answers?.ahead) {
    setStatus("error: the result has no answer for ahead", true);
  } else if (capturedAt === null) {
    setStatus(`error: a result for frame ${message.frame}, which this page did not send`, true);
  } else {
    const answerMs = performance.now() - capturedAt;
    if (answerMs <= STALE_MS) {
      render(message, capturedAt, answerMs);
    } else {
      tooSlow(answerMs);
    }
  }
  if (performance.now() - state.errorAt > ERROR_LINGER_MS) {
    const frames = `${state.frames} frame${state.frames === 1 ? "" : "s"}`;
    setStatus(`running · ${frames}${state.dropped ? ` · ${state.dropped} dropped` : ""}`);
  }
  ui.banner.dataset.slow = state.slow;
  setPace(link, message.next_frame_ms);
  stepPaced(link);
}

// An answer that arrived older than the limit is not shown, whatever the settings: the page says
// answers are too slow to walk with (and, with thinking on, that thinking is why).
function tooSlow(answerMs) {
  state.slow += 1;
  showNoAnswer(); // the label is deliberately not shown
  ui.meta.textContent = `too slow · ${Math.round(answerMs)} ms · limit ${STALE_MS} ms`;
  const advice = ui.think.checked ? "; turn thinking off" : "";
  const ms = Math.round(answerMs);
  // The advice first: on a phone the line is cut at its end (the meta line above has the numbers).
  setStatus(`answers are too slow to walk with${advice} (${ms} ms from capture, limit ${STALE_MS} ms)`, true);
  if (!state.slowSaid) {
    state.slowSaid = true; // said once a run; the screen keeps saying it
    voice.say(`answers are too slow to walk with${advice}`);
  }
}

// A frame's error is reported and the next frame goes out at the pace; the guard counts on (a server
// that answers only errors reaches "no answer" within STALE_MS). A config error (frame null) would
// fail every frame, so it ends the run.
function onError(link, message) {
  const text = errorMessage(message.status, message).replace(/^HTTP \d+: /, "");
  if (message.frame == null) {
    halt(text);
    return;
  }
  setStatus(`error: ${text}`, true);
  takeCaptureTime(link, message.frame);
  link.inFlight = false;
  setPace(link, message.next_frame_ms);
  stepPaced(link);
}

// The socket closed under a running loop: a refused key ends the run; anything else is "no answer"
// at once while the page reconnects.
function onClose(event) {
  state.link = null;
  const reason = event.reason ? `: ${event.reason}` : "";
  if (event.code === 1008) {
    halt(`api key refused${reason}`);
    return;
  }
  showNoAnswer();
  let wait = RECONNECT_MS;
  if (event.code === 1013) {
    wait = busyWait(state.busyRefusals++);
    setStatus(`server busy${reason}; trying again in ${(wait / 1000).toFixed(1)} s`, true);
  } else {
    setStatus(`error: stream closed (${event.code}${reason}); reconnecting`, true);
  }
  state.reconnectTimer = setTimeout(() => state.running && !state.suspended && openSession(), wait);
}

// The wait before asking a full server again, after `refusals` 1013 closes in a row.
function busyWait(refusals) {
  const base = Math.min(BUSY_MAX_MS, BUSY_FIRST_MS * 2 ** refusals);
  return Math.round(base * (0.5 + Math.random()));
}

// A phone that locks or switches apps stops streaming (and paying for frames); visible again, the
// loop comes back with the screen lock, showing "no answer" until a fresh answer arrives.
function onVisibility() {
  if (!state.running) return;
  if (document.hidden && !state.suspended) {
    state.suspended = true;
    suspend();
    setBanner("paused", "idle"); // what is seen first on coming back, until "looking..."
    hideArrow();
    showAge(null, STALE_MS);
    setStatus("paused while the page is hidden");
  } else if (!document.hidden && state.suspended) {
    screenLock.regain();
    resume();
  }
}

// ------------------------------------------------------------------ service worker

// The page shell (this page, its scripts, styles, icons and manifest) is kept by a service worker
// so the installed page opens without the network; answers never are. Browsers refuse a service
// worker on a certificate they do not trust, so the page only tries where the context is secure,
// and a refusal changes nothing.
function registerShell() {
  if (!window.isSecureContext || !navigator.serviceWorker) return;
  navigator.serviceWorker.register("/sw.js", { scope: "/walk" }).then(
    () => { document.body.dataset.shell = "registered"; },
    () => { document.body.dataset.shell = "refused"; },
  );
}

// ------------------------------------------------------------------ wiring

function init() {
  buildBars(HAZARDS);
  bindApiKeyInput(ui.apiKey);
  setMuteButton(voice);
  showAge(null, STALE_MS);
  ui.think.checked = false; // browsers may restore form state on reload
  ui.toggle.addEventListener("click", () => (state.running ? stop() : start()));
  ui.stage.addEventListener("click", () => { if (!state.running) start(); });
  ui.mute.addEventListener("click", () => {
    voice.setMuted(!voice.muted);
    setMuteButton(voice);
  });
  // The next frame uses the new config; no need to reconnect.
  ui.think.addEventListener("change", () => state.link?.session.configure(buildRequest()));
  document.addEventListener("visibilitychange", onVisibility);
  ui.banner.dataset.staleMs = STALE_MS;

  if (!navigator.mediaDevices?.getUserMedia) {
    setStatus(cameraError(new Error("no camera API")), true);
  } else if (document.body.dataset.keyRequired === "true" && !ui.apiKey.value) {
    setStatus("this server needs an api key");
  } else {
    setStatus("ready");
  }
  registerShell();
}

init();
