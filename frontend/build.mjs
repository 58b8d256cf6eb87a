// Build the console's browser assets into dist/console/ (served by Django as static files):
// plotly.js from npm, unchanged, and the console's live-refresh module.
import { copyFileSync, mkdirSync, rmSync, statSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
const out = join(here, "dist", "console");

rmSync(join(here, "dist"), { recursive: true, force: true });
mkdirSync(out, { recursive: true });

const assets = [
  [require.resolve("plotly.js-dist-min/plotly.min.js"), "plotly.min.js"],
  [join(here, "src", "console.js"), "console.js"],
];
for (const [source, name] of assets) {
  copyFileSync(source, join(out, name));
  console.log(`dist/console/${name}  ${(statSync(join(out, name)).size / 1024).toFixed(0)} KiB`);
}
