// The walk page's drawing: the banner, arrow and age badge over the video, the bars, meta and
// status lines and the buttons below it. Every box has a fixed size (walk.css), so drawing changes
// only text, colors and widths: nothing moves.

const $ = (id) => document.getElementById(id);
export const ui = {
  stage: $("stage"), video: $("video"), canvas: $("canvas"), arrow: $("arrow"), banner: $("banner"),
  age: $("age"), toggle: $("toggle"), mute: $("mute"), think: $("think"), meta: $("meta"), bars: $("bars"),
  apiKey: $("api-key"), status: $("status"),
};

const ARROWS = { "go ahead": "↑", "turn left": "←", "turn right": "→" };
const barRows = new Map(); // label -> {row, fill, pct}

export function hazardClass(label) {
  if (label.startsWith("all clear")) return "clear";
  if (label.startsWith("danger")) return "danger";
  if (label.startsWith("door")) return "door";
  return "idle";
}

export function setBanner(text, kind) {
  ui.banner.textContent = text;
  ui.banner.className = `banner ${kind}`;
}

export function setArrow(choice, confidence) {
  const text = `${choice} ${percent(confidence)}%`;
  ui.arrow.textContent = ARROWS[choice];
  ui.arrow.className = `arrow ${choice === "go ahead" ? "go" : "turn"}`;
  ui.arrow.title = text;
  ui.arrow.setAttribute("aria-label", text);
  ui.arrow.dataset.choice = choice;
}

export function hideArrow() {
  ui.arrow.className = "arrow off";
  ui.arrow.textContent = "";
  ui.arrow.title = "";
  ui.arrow.setAttribute("aria-label", "no direction yet");
  delete ui.arrow.dataset.choice;
}

export function setToggle(running) {
  ui.toggle.textContent = running ? "Stop" : "Start";
  ui.toggle.classList.toggle("running", running);
}

export function setMuteButton(voice) {
  if (!voice.available) {
    ui.mute.textContent = "no voice";
    ui.mute.disabled = true;
    ui.mute.title = "this browser has no speech synthesis: watch the banner, feel the vibrations";
    return;
  }
  ui.mute.textContent = voice.muted ? "voice off" : "voice on";
  ui.mute.setAttribute("aria-pressed", String(voice.muted));
  ui.mute.classList.toggle("muted", voice.muted);
  ui.mute.title = voice.muted ? "spoken cues are off (remembered on this phone)" : "spoken cues are on";
}

// The age of the answer on screen, from the capture of its frame.
export function showAge(ms, limitMs) {
  if (ms === null) {
    ui.age.textContent = "";
    ui.age.className = "age off";
    return;
  }
  ui.age.textContent = `${(ms / 1000).toFixed(1)} s`;
  ui.age.className = `age${ms > limitMs ? " stale" : ""}`;
}

export const percent = (p) => Math.round(Math.max(0, Math.min(1, Number(p) || 0)) * 100);

// The rows exist before the first result, so a result only changes widths and numbers.
export function buildBars(hazards) {
  for (const label of Object.keys(hazards)) {
    const row = document.createElement("div");
    row.className = `bar-row ${hazardClass(label)}`;
    row.dataset.label = label;
    row.title = hazards[label];
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

export function updateBars(probabilities, top) {
  for (const [label, { row, fill, pct }] of barRows) {
    const p = probabilities?.[label] ?? 0;
    fill.style.width = `${(Math.max(0, Math.min(1, p)) * 100).toFixed(1)}%`;
    pct.textContent = `${percent(p)}%`;
    row.classList.toggle("top", label === top);
  }
}

// diagnostics.thought is null, one {tokens, ...}, or a list of them (one per read that thought,
// e.g. two on a blocked frame).
export function thoughtTokens(thought) {
  const list = Array.isArray(thought) ? thought : [thought];
  return list.reduce((sum, t) => sum + (Number(t?.tokens) || 0), 0);
}

// The meta line: confidence, the capture-to-answer time, thought tokens, the obstacle's side.
export function metaText(message, confidence, answerMs, obstacle) {
  let meta = `${percent(confidence)}% · ${Math.round(answerMs)} ms`;
  const tokens = thoughtTokens(message.diagnostics?.thought);
  if (tokens) meta += ` · thought ${tokens} tok`;
  if (obstacle) meta += ` · obstacle ${obstacle}`;
  return meta;
}
