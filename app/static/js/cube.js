// Cube Rule Live (/cube): 27 food photos, one structured read each, every card flies from the pool
// into the row of the category the model chose, sorted by probability (highest first).
// Live runs ask the server this page came from; Replay animates a recorded run (replay.json).
import { bindApiKeyInput, apiKey, postDecision, errorMessage } from "/static/js/api.js";

const BASE = "/static/cube/";
export const CATEGORIES = ["toast", "sandwich", "taco", "sushi", "quiche", "calzone", "salad", "soup"];

// The request sent with every photo. Kept as strict JSON between the markers:
// scripts/record_cube_replay.py reads it from here, so the replay asks exactly what the page asks.
export const REQUEST = /* request-json */ {
  "model": "jev-latest",
  "state": {"note": "a photo of a food from its encyclopedia page"},
  "questions": {
    "cube": {
      "type": "choice",
      "instructions": "Under the Cube Rule of food identification, a food's category depends only on where its structural starch sits. Which category is the food in the photo?",
      "criteria": {
        "toast": "starch on the bottom only (toast, pizza, an open-faced tart)",
        "sandwich": "starch on the top and the bottom (a sandwich, a burger; a hot dog in a bun is a taco though)",
        "taco": "starch on the bottom and two opposite sides (a taco, a hot dog bun, a folded pizza slice)",
        "sushi": "starch on four sides around a filling (sushi, a burrito, an enchilada)",
        "quiche": "starch on five sides with an open top (a quiche, a pie, a bread bowl)",
        "calzone": "starch on all six sides, fully enclosed (a calzone, a dumpling, a pop tart, ravioli)",
        "salad": "no structural starch at all (a salad, a steak, ice cream out of a cone)",
        "soup": "no structural starch either, and the food is liquid, served in a bowl or a cup (soup, stew, ramen, a drink)"
      }
    }
  },
  "seed": 7,
  "samples": 1
} /* end-request-json */;

const REPLAY_MAX_WAIT_MS = 450;
const USER_PHOTO_SIDE = 512;
const reducedMotion = window.matchMedia("(prefers-reduced-motion: reduce)");

// ?theme=light or ?theme=dark overrides the system palette.
const theme = new URLSearchParams(location.search).get("theme");
if (theme === "light" || theme === "dark") document.documentElement.dataset.theme = theme;

const $ = (id) => document.getElementById(id);
const els = {
  main: $("cube"), run: $("run-live"), replay: $("replay"), reset: $("reset"), add: $("add-photo"),
  key: $("api-key"), status: $("status"), pool: $("pool"), drop: $("pool-wrap"), fly: $("fly-layer"),
  recorded: $("recorded"),
};

let foods = [];  // {name, file, category, note, url, blob?, user?}
let replay = null;  // replay.json
const extras = [];  // the user's own photos: cards in the pool, classified by the next live run
let live = false;  // /health answered ok
let runId = 0;  // bumped by every run and reset: a stale loop stops at its next step
let running = false;
let userCount = 0;

function setStatus(text, error = false) {
  els.status.textContent = text;
  els.status.title = text;
  els.status.classList.toggle("status-error", error);
}

function setState(state) {
  els.main.dataset.state = state;
}

const pct = (p) => `${Math.round(p * 100)}%`;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// The chosen category: the answer's choice live, the highest recorded probability in a replay.
export function argmax(probabilities) {
  let best = null;
  for (const [name, p] of Object.entries(probabilities || {})) {
    if (best === null || p > probabilities[best]) best = name;
  }
  return best;
}

// ---- cards -------------------------------------------------------------------------------------

function makeCard(food, p = null) {
  const card = document.createElement(food.user ? "div" : "a");
  card.className = "card";
  if (!food.user) {
    card.href = food.url;
    card.target = "_blank";
    card.rel = "noopener";
  } else {
    card.classList.add("user");
  }
  card.dataset.name = food.name;
  card.title = food.note ? `${food.name}: ${food.note}` : food.name;
  const img = document.createElement("img");
  img.src = food.url;
  img.alt = food.name;
  img.width = 92;
  img.height = 92;
  img.decoding = "async";
  img.draggable = false;
  const label = document.createElement("span");
  label.className = "label";
  const name = document.createElement("span");
  name.className = "name";
  name.textContent = food.name;
  const percent = document.createElement("span");
  percent.className = "pct";
  label.append(name);
  card.append(img, label, percent);
  setP(card, p);
  return card;
}

function setP(card, p) {
  const percent = card.querySelector(".pct");
  if (p === null || p === undefined) {
    delete card.dataset.p;
    card.style.removeProperty("--p");
    percent.textContent = "";
  } else {
    card.dataset.p = String(p);
    card.style.setProperty("--p", String(Math.max(0, Math.min(1, p))));
    percent.textContent = pct(p);
  }
}

function poolCard(food) {
  return [...els.pool.querySelectorAll(".card")].find((card) => card.food === food) || null;
}

function rowOf(category) {
  return els.main.querySelector(`.row[data-category="${category}"]`);
}

function updateCount(row) {
  const n = row.querySelectorAll(".track .card").length;
  row.dataset.count = String(n);
  row.querySelector(".count").textContent = String(n);
}

function updatePoolEmpty() {
  els.pool.classList.toggle("empty", !els.pool.querySelector(".card"));
}

// Reset rebuilds the board: every food (and every photo the user added) back in the pool.
function buildBoard() {
  els.pool.replaceChildren();
  for (const food of [...extras, ...foods]) {  // the user's photos first, as a live run reads them
    const card = makeCard(food);
    card.food = food;
    els.pool.append(card);
  }
  for (const row of els.main.querySelectorAll(".row")) {
    row.querySelector(".track").replaceChildren();
    updateCount(row);
  }
  els.fly.replaceChildren();
  els.pool.scrollLeft = 0;
  updatePoolEmpty();
}

// ---- animation ---------------------------------------------------------------------------------

const animate = (el, frames, options) => (reducedMotion.matches ? null : el.animate(frames, options));

// FLIP: call before a layout change, run the returned function after it.
function flip(cards, axis = "x") {
  const before = new Map(cards.map((card) => [card, card.offsetLeft]));
  return () => {
    for (const [card, left] of before) {
      if (!card.isConnected) continue;
      const dx = left - card.offsetLeft;
      if (dx) animate(card, [{ transform: `translate${axis.toUpperCase()}(${dx}px)` }, { transform: "none" }],
                      { duration: 520, easing: "cubic-bezier(.2,.8,.2,1)" });
    }
  };
}

function centerIn(track, card, smooth = false) {
  const left = card.offsetLeft - (track.clientWidth - card.offsetWidth) / 2;
  track.scrollTo({ left: Math.max(0, left), behavior: smooth && !reducedMotion.matches ? "smooth" : "instant" });
}

function flyClone(card, from, to) {
  if (reducedMotion.matches || !from || from.width === 0) return Promise.resolve();
  const clone = card.cloneNode(true);
  clone.classList.remove("ghost");
  clone.classList.add("flying");
  Object.assign(clone.style, { left: `${from.left}px`, top: `${from.top}px`, width: `${from.width}px`, height: `${from.height}px` });
  els.fly.append(clone);
  const dx = to.left - from.left;
  const dy = to.top - from.top;
  const lift = Math.min(80, Math.abs(dy) / 3 + 20);
  const animation = clone.animate([
    { transform: "translate(0, 0) scale(1)", boxShadow: "0 2px 6px rgba(0,0,0,.2)" },
    { transform: `translate(${dx * 0.5}px, ${dy * 0.5 - lift}px) scale(1.12)`, boxShadow: "0 18px 30px rgba(0,0,0,.3)", offset: 0.5 },
    { transform: `translate(${dx}px, ${dy}px) scale(1)`, boxShadow: "0 2px 6px rgba(0,0,0,.2)" },
  ], { duration: 700, easing: "cubic-bezier(.45,.05,.35,1)" });
  return animation.finished.catch(() => {}).finally(() => clone.remove());
}

// ---- placing a result --------------------------------------------------------------------------

function place(food, top, p) {
  const row = rowOf(top);
  if (!row) throw new Error(`the answer names no row: ${top}`);
  const track = row.querySelector(".track");
  const old = poolCard(food);
  const from = old ? old.getBoundingClientRect() : null;
  const poolFlip = flip([...els.pool.querySelectorAll(".card")].filter((card) => card !== old));
  old?.remove();
  updatePoolEmpty();
  poolFlip();

  const card = makeCard(food, p);
  card.food = food;
  const members = [...track.querySelectorAll(".card")];
  const trackFlip = flip(members);
  const before = members.find((member) => Number(member.dataset.p) < p) || null;  // highest first
  track.insertBefore(card, before);
  updateCount(row);
  centerIn(track, card);
  trackFlip();

  card.classList.add("ghost");
  const to = card.getBoundingClientRect();
  flyClone(card, from, to).then(() => {
    card.classList.remove("ghost");
    animate(card, [{ opacity: 0.4, transform: "scale(.82)" }, { opacity: 1, transform: "scale(1)" }],
            { duration: 420, easing: "cubic-bezier(.2,.9,.3,1.3)" });
  });
}

// ---- reading -----------------------------------------------------------------------------------

async function photoBlob(food) {
  if (food.blob) return food.blob;
  const response = await fetch(food.url);
  if (!response.ok) throw new Error(`photo ${food.file}: HTTP ${response.status}`);
  const blob = await response.blob();
  return new File([blob], "a.jpg", { type: blob.type || "image/jpeg" });
}

async function readLive(food) {
  const photo = await photoBlob(food);
  const started = performance.now();
  const result = await postDecision(REQUEST, [photo], { field: "photo" });
  if (!result.ok) throw new Error(errorMessage(result.status, result.body, result.text));
  const answer = result.body?.answers?.cube;
  if (!answer || !answer.probabilities) throw new Error("the answer has no cube choice");
  return { top: answer.choice ?? argmax(answer.probabilities), cube: answer.probabilities,
           ms: Math.round(performance.now() - started) };
}

async function readReplay(food) {
  const entry = replay?.foods?.[food.name];
  if (!entry) return null;
  await sleep(Math.min(entry.ms ?? 0, REPLAY_MAX_WAIT_MS));
  return { top: argmax(entry.cube), cube: entry.cube, ms: entry.ms };
}

function setBusy(busy) {
  running = busy;
  els.run.disabled = busy || !live;
  els.replay.disabled = busy || !replay;
  els.main.classList.toggle("busy", busy);
}

async function run(mode) {
  const id = ++runId;
  buildBoard();
  setBusy(true);
  setState(mode);
  // The user's own photos go first in a live run: they were just added, and nothing recorded them.
  const order = mode === "live" ? [...extras, ...foods] : [...foods];
  let failed = false;
  try {
    for (const food of order) {
      if (id !== runId) return;
      const card = poolCard(food);
      if (!card) continue;
      card.classList.add("reading");
      card.querySelector(".pct").textContent = "…";
      centerIn(els.pool, card, true);
      setStatus(`reading ${food.name}${mode === "replay" ? " (replay)" : ""}`);
      const result = mode === "live" ? await readLive(food) : await readReplay(food);
      if (id !== runId) return;
      if (!result) {  // a photo of the user's: nothing recorded for it
        card.classList.remove("reading");
        card.querySelector(".pct").textContent = "live only";
        continue;
      }
      const p = result.cube[result.top] ?? 0;
      setStatus(`${food.name}: ${result.top} ${pct(p)}, ${result.ms} ms`);
      place(food, result.top, p);
    }
  } catch (error) {
    if (id !== runId) return;
    failed = true;
    for (const card of els.pool.querySelectorAll(".card.reading")) {
      card.classList.remove("reading");
      card.querySelector(".pct").textContent = "";
    }
    setStatus(`error: ${error.message || error}`, true);
  } finally {
    if (id === runId) {
      setBusy(false);
      setState(failed ? "error" : "done");
      if (!failed) {
        const placed = els.main.querySelectorAll(".rows .card").length;
        setStatus(`${els.status.textContent} · done: ${placed} placed${mode === "replay" ? " (replay)" : ""}`);
      }
      setTimeout(() => {
        for (const track of els.main.querySelectorAll(".track")) {
          track.scrollTo({ left: 0, behavior: reducedMotion.matches ? "instant" : "smooth" });
        }
      }, reducedMotion.matches ? 0 : 760);
    }
  }
}

function reset() {
  runId += 1;
  buildBoard();
  setBusy(false);
  setState("idle");
  setStatus(live ? "ready: Run live asks the server, Replay animates the recorded run" : "ready: Replay animates the recorded run");
}

// ---- the user's own photos ----------------------------------------------------------------------

async function scaled(file) {
  // At most 512 px on the long side, as JPEG: what the recorded photos are.
  const bitmap = await createImageBitmap(file);
  const scale = Math.min(1, USER_PHOTO_SIDE / Math.max(bitmap.width, bitmap.height));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(bitmap.width * scale));
  canvas.height = Math.max(1, Math.round(bitmap.height * scale));
  const context = canvas.getContext("2d");
  context.fillStyle = "#fff";  // transparent PNGs on white, not black
  context.fillRect(0, 0, canvas.width, canvas.height);
  context.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close?.();
  const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", 0.85));
  if (!blob) throw new Error("could not encode the photo");
  return new File([blob], "a.jpg", { type: "image/jpeg" });
}

async function addPhotos(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  if (!images.length) {
    setStatus("error: drop image files (JPEG, PNG, WebP)", true);
    return;
  }
  let added = 0;
  for (const file of images) {
    try {
      const blob = await scaled(file);
      userCount += 1;
      const base = (file.name || "").replace(/\.[^.]+$/, "").replace(/[_-]+/g, " ").trim().slice(0, 40);
      const food = { name: base || `your photo ${userCount}`, note: "your photo", user: true, blob,
                     url: URL.createObjectURL(blob), id: `user-${userCount}` };
      extras.push(food);
      const card = makeCard(food);
      card.food = food;
      els.pool.insertBefore(card, els.pool.querySelector(".card:not(.user)"));
      updatePoolEmpty();
      centerIn(els.pool, card, true);
      added += 1;
    } catch (error) {
      setStatus(`error: ${file.name}: ${error.message || error}`, true);
      return;
    }
  }
  const next = live ? (running ? "the next live run reads" : "Run live reads") : "a live run (needs the djev server) reads";
  setStatus(`added ${added} photo${added === 1 ? "" : "s"}: ${next} ${added === 1 ? "it" : "them"}`);
}

function bindDrop() {
  const zone = els.drop;
  let depth = 0;
  zone.addEventListener("dragenter", (event) => { event.preventDefault(); depth += 1; zone.classList.add("drag"); });
  zone.addEventListener("dragleave", () => { depth = Math.max(0, depth - 1); if (!depth) zone.classList.remove("drag"); });
  zone.addEventListener("dragover", (event) => { event.preventDefault(); event.dataTransfer.dropEffect = "copy"; });
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    depth = 0;
    zone.classList.remove("drag");
    if (event.dataTransfer?.files?.length) addPhotos(event.dataTransfer.files);
  });
  // A drop that misses the pool must not navigate away from the page.
  window.addEventListener("dragover", (event) => event.preventDefault());
  window.addEventListener("drop", (event) => event.preventDefault());
  els.add.addEventListener("change", () => {
    if (els.add.files?.length) addPhotos(els.add.files);
    els.add.value = "";
  });
}

// ---- start -------------------------------------------------------------------------------------

async function checkHealth() {
  try {
    const response = await fetch("/health", { cache: "no-store" });
    const body = await response.json().catch(() => null);
    return { reachable: true, ok: response.ok && body?.status === "ok" };
  } catch (_) {
    return { reachable: false, ok: false };
  }
}

function setLive(ok) {
  live = ok;
  els.run.disabled = running || !ok;
  els.run.title = ok ? "classify every photo on the djev server" : "needs the djev server";
}

function describeReplay() {
  if (!els.recorded) return;
  const r = replay?.recorded;
  if (!r) {
    els.recorded.textContent = "No recorded run was found, so Replay is off.";
    return;
  }
  const tiny = /tiny/i.test(r.model || "");
  els.recorded.textContent = `The replay was recorded on ${r.model} (${r.engine}, ${r.device}) on ${r.date}, seed ${r.seed}` +
    (tiny ? ": that is the tiny random-weight test model, so its choices are random, not a judgement about food." : ".");
}

async function start() {
  bindApiKeyInput(els.key);
  bindDrop();
  els.run.addEventListener("click", () => run("live"));
  els.replay.addEventListener("click", () => run("replay"));
  els.reset.addEventListener("click", reset);
  setLive(false);
  els.replay.disabled = true;
  setStatus("loading the foods…");
  try {
    const [foodsResponse, replayResponse] = await Promise.all([fetch(`${BASE}foods.json`), fetch(`${BASE}replay.json`)]);
    if (!foodsResponse.ok) throw new Error(`foods.json: HTTP ${foodsResponse.status}`);
    foods = (await foodsResponse.json()).map((food) => ({ ...food, url: BASE + food.file }));
    replay = replayResponse.ok ? await replayResponse.json() : null;
  } catch (error) {
    setStatus(`error: ${error.message || error}`, true);
    setState("error");
    return;
  }
  describeReplay();
  buildBoard();
  els.replay.disabled = !replay;
  setState("idle");
  const health = await checkHealth();
  setLive(health.ok);
  const needsKey = document.body.dataset.keyRequired === "true" && !apiKey();
  if (health.ok && !needsKey) {
    run("live");
  } else if (health.ok) {
    setStatus("this server needs an api key: enter it, then Run live");
  } else if (replay) {
    run("replay");
  } else {
    setStatus("the djev server is not answering and there is no recorded run", true);
  }
  if (!health.ok) {
    // The server may come up later: keep asking, quietly, and enable Run live when it answers.
    const timer = setInterval(async () => {
      const again = await checkHealth();
      if (again.ok) { setLive(true); clearInterval(timer); }
    }, 10000);
  }
}

start();
